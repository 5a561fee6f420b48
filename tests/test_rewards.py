"""GSM8K rule reward and the reward registry."""

import json
import sys
from pathlib import Path

import pytest
from conftest import GSM8K_DIR

from megarl.rewards import RewardResult, get_reward_fn, known_data_sources, register_reward
from megarl.rewards.gsm8k import answers_match, compute_score, extract_answer, gold_answer


@pytest.mark.parametrize(("split", "count"), [("test", 1319), ("train", 7473)])
def test_every_gold_answer_scores_one_in_strict_mode(split: str, count: int) -> None:
    rows = [json.loads(line) for line in (GSM8K_DIR / f"{split}.jsonl").open()]
    assert len(rows) == count
    scores = [compute_score(r["answer"], gold_answer(r["answer"])).score for r in rows]
    assert scores == [1.0] * count


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 3 + 4 = 7\n#### 7", "7", "7"),
        ("the answer is 7", None, "7"),
        ("#### 1,000", "1000", "1000"),
        ("#### $1,000.", "1000", "1000"),
        ("#### -12", "-12", "-12"),
        ("#### 2.5", "2.5", "2.5"),
        ("#### 3\nwait, #### 4", "4", "4"),
        ("total is 42.", None, "42"),
        ("no numbers here.", None, None),
    ],
)
def test_extract_answer(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_extract_answer_looks_at_the_tail_only() -> None:
    assert extract_answer("#### 5 " + "x" * 400) is None
    with pytest.raises(ValueError, match="method='loose'"):
        extract_answer("#### 1", "loose")


def test_scores() -> None:
    right = compute_score("#### 18", "18")
    assert right == RewardResult(1.0, {"pred": "18", "format_ok": True, "acc": True})
    assert compute_score("#### 18.0", "18").score == 1.0
    assert compute_score("#### 17", "18", format_score=0.1).score == 0.1
    assert compute_score("I think 18", "18", format_score=0.1).score == 0.0
    assert compute_score("I think 18", "18", method="flexible").score == 1.0
    assert answers_match("$1,000", "1000.0") and not answers_match("abc", "1")
    with pytest.raises(ValueError, match="'#### N'"):
        gold_answer("no marker")


def test_registry_resolves_sources_and_reports_unknown() -> None:
    assert get_reward_fn("openai/gsm8k") is compute_score is get_reward_fn("gsm8k")
    assert {"gsm8k", "openai/gsm8k"} <= set(known_data_sources())
    with pytest.raises(ValueError, match=r"no reward function for data_source 'math500' \(known: .*gsm8k"):
        get_reward_fn("math500")


def test_registry_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="already has reward function"):
        register_reward("gsm8k")(lambda *a, **k: RewardResult(0.0))


def test_dotted_path_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "from megarl.rewards import RewardResult\n"
        "def length(solution_str, ground_truth, extra_info=None):\n"
        "    return RewardResult(float(len(solution_str)))\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("my_rewards:length", "my_rewards.length"):
        assert get_reward_fn("anything", override=path)("abcd", "").score == 4.0
    with pytest.raises(ValueError, match="cannot import 'my_rewards:missing'"):
        get_reward_fn("x", override="my_rewards:missing")
    with pytest.raises(ValueError, match="cannot import 'no_such_module:f'"):
        get_reward_fn("x", override="no_such_module:f")
    with pytest.raises(ValueError, match="is a int, not a function"):
        get_reward_fn("x", override="my_rewards:NOT_CALLABLE")
    sys.modules.pop("my_rewards", None)
