"""GSM8K rule reward and the reward registry."""

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarl.rewards import RewardResult, get_reward_fn, known_data_sources, register_reward, registry
from megarl.rewards.gsm8k import TAIL_CHARS, answers_match, compute_score, extract_answer, gold_answer

GSM8K_DIR = Path(__file__).resolve().parents[3] / "data/gsm8k"


@pytest.mark.parametrize(("split", "num_rows"), [("test", 1319), ("train", 7473)])
def test_every_gold_answer_scores_one_in_strict_mode(split: str, num_rows: int) -> None:
    with (GSM8K_DIR / f"{split}.jsonl").open() as f:
        answers = [json.loads(line)["answer"] for line in f]
    assert len(answers) == num_rows
    results = [compute_score(answer, gold_answer(answer)) for answer in answers]
    assert [r.score for r in results] == [1.0] * num_rows
    assert all(r.extra["acc"] and r.extra["format_ok"] for r in results)


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 3 + 4 = 7\n#### 7", "7", "7"),
        ("the answer is 7", None, "7"),
        ("####7", "7", "7"),
        ("#### 1,000", "1000", "1000"),
        ("#### $1,000.", "1000", "1000"),
        ("#### -$12 in debt", "-12", "-12"),
        ("#### 2.5", "2.5", "2.5"),
        ("**#### 18**", "18", "18"),
        ("#### 3\nwait, #### 4", "4", "4"),
        ("#### 3\n#### see above", None, "3"),
        ("#### 5 dollars, it took 2 days", "5", "2"),
        ("total is 42.", None, "42"),
        ("ids 3,4,5", None, "5"),
        ("pages 3-4", None, "4"),
        ("no numbers here. , .", None, None),
        ("####", None, None),
    ],
)
def test_extract_answer(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_extract_answer_reads_the_tail_only() -> None:
    assert extract_answer("#### 5" + "x" * TAIL_CHARS) is None
    assert extract_answer("x" * 10 * TAIL_CHARS + "#### 5") == "5"


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"method='loose' is unknown; .*strict, flexible"):
        extract_answer("#### 1", "loose")
    with pytest.raises(ValueError, match="method='loose'"):
        compute_score("#### 1", "1", method="loose")


def test_scores() -> None:
    assert compute_score("#### 18", "18") == RewardResult(1.0, {"format_ok": True, "acc": True}, "18")
    assert compute_score("#### 18.0", "18").score == 1.0
    assert compute_score("#### 18", "18", score=2.0).score == 2.0
    wrong = compute_score("#### 17", "18", format_score=0.1)
    assert wrong == RewardResult(0.1, {"format_ok": True, "acc": False}, "17")
    missing = compute_score("I think 18", "18", format_score=0.1)
    assert missing == RewardResult(0.0, {"format_ok": False, "acc": False}, None)
    assert compute_score("I think 18", "18", method="flexible").score == 1.0


def test_answers_match_and_gold_answer() -> None:
    assert answers_match("18.0", "18") and answers_match("$1,000.", "1000") and answers_match(" -3 ", "-3.00")
    assert not answers_match("18", "19") and not answers_match("abc", "1")
    assert answers_match("abc", " abc. ") and answers_match("nan", "nan")
    assert gold_answer("She pays 2 * 500 = <<2*500=1000>>1000.\n#### 1,000") == "1000"
    with pytest.raises(ValueError, match="no '#### N' final line"):
        gold_answer("no marker")
    with pytest.raises(ValueError, match="nothing after its '####'"):
        gold_answer("72\n####")


def test_registry_resolves_sources_and_reports_unknown() -> None:
    assert get_reward_fn("openai/gsm8k") is compute_score is get_reward_fn("gsm8k")
    assert {"gsm8k", "openai/gsm8k"} <= set(known_data_sources())
    with pytest.raises(ValueError, match=r"data_source 'math500' \(known: .*'openai/gsm8k'.*reward\.function"):
        get_reward_fn("math500")


def test_registry_registers_and_rejects_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("toy/a", "toy/b")
    def toy(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
        return RewardResult(1.0)

    assert get_reward_fn("toy/a") is toy is get_reward_fn("toy/b")
    assert register_reward("toy/a")(toy) is toy
    with pytest.raises(ValueError, match=r"'gsm8k' already has reward function megarl\.rewards\.gsm8k\.compute_score"):
        register_reward("toy/c", "gsm8k")(lambda *args, **kwargs: RewardResult(0.0))
    assert "toy/c" not in known_data_sources()
    with pytest.raises(ValueError, match="at least one data_source"):
        register_reward()


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user reward module `my_rewards` importable from a temporary directory."""
    (tmp_path / "my_rewards.py").write_text(
        "from megarl.rewards import RewardResult\n"
        "def length(solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return RewardResult(float(len(solution_str)))\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_dotted_path_override(user_module: str) -> None:
    for path in ("my_rewards:length", "my_rewards.length"):
        assert get_reward_fn("openai/gsm8k", override=path)("abcd", "").score == 4.0
    with pytest.raises(ValueError, match=r"cannot import 'my_rewards:missing'.*missing"):
        get_reward_fn("gsm8k", override="my_rewards:missing")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module\.f'.*no_such_module"):
        get_reward_fn("gsm8k", override="no_such_module.f")
    with pytest.raises(ValueError, match="'my_rewards:NOT_CALLABLE' is a int, not a function"):
        get_reward_fn("gsm8k", override="my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="not a dotted path"):
        get_reward_fn("gsm8k", override="my_rewards")
