"""The judge's reply parsers: the last number, the last \\boxed{x}, P(yes) from first-position log-probs; the mapping
of `score_range` onto [0, 1]; the start-up checks of the judge's tokenizer."""

import math
from pathlib import Path

import pytest

from megarl.assets import asset_path
from megarl.config.reward import GenerativeRMConfig
from megarl.rewards.retry import Transient
from megarl.scoring.judge import JudgeSource, judge_problems, parse_boxed, parse_number, parse_yes_no, scaled


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("7", 0.7),
        ("Rating: 3 out of 10, no wait, 8", 0.8),
        ("score 2.5", 0.25),
        ("I'd say .5", 0.05),
        ("12/10!", 1.0),  # the last number is 10
        ("15", 1.0),  # clipped above
        ("-3", 0.0),  # clipped below
        ("10.", 1.0),
    ],
)
def test_number_takes_the_last_number_scaled_and_clipped(reply: str, expected: float) -> None:
    assert parse_number(reply, [0.0, 10.0]) == pytest.approx(expected)


def test_score_range_maps_low_to_zero_and_high_to_one() -> None:
    assert parse_number("1", [1.0, 5.0]) == 0.0
    assert parse_number("5", [1.0, 5.0]) == 1.0
    assert parse_number("4", [1.0, 5.0]) == pytest.approx(0.75)
    assert scaled(-1.0, [-2.0, 2.0]) == pytest.approx(0.25)


@pytest.mark.parametrize("reply", ["", "no idea", "ten out of ten"])
def test_a_reply_without_a_number_is_transient(reply: str) -> None:
    with pytest.raises(Transient, match="holds no number"):
        parse_number(reply, [0.0, 10.0])


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("\\boxed{7}", 0.7),
        ("first \\boxed{2}, finally \\boxed{ 9 } and 1", 0.9),  # the last box, not the last number
        ("\\boxed{42}", 1.0),
        ("\\boxed{-1.5}", 0.0),
    ],
)
def test_boxed_takes_the_last_box(reply: str, expected: float) -> None:
    assert parse_boxed(reply, [0.0, 10.0]) == pytest.approx(expected)


@pytest.mark.parametrize("reply", ["7", "\\boxed{}", "\\boxed{seven}", "\\boxed{7", "boxed{7}"])
def test_boxed_without_a_boxed_number_is_transient(reply: str) -> None:
    with pytest.raises(Transient, match="boxed"):
        parse_boxed(reply, [0.0, 10.0])


def test_yes_no_is_the_ratio_of_the_two_probabilities() -> None:
    yes, no = math.log(0.3), math.log(0.1)
    assert parse_yes_no({5: yes, 9: no, 1: math.log(0.6)}, 5, 9) == pytest.approx(0.75)
    assert parse_yes_no({5: -math.inf, 9: no}, 5, 9) == 0.0
    assert parse_yes_no({5: yes}, 5, 9) == 1.0  # no log-prob for "no": P(no) = 0
    assert parse_yes_no({5: -1000.0, 9: -1.0}, 5, 9) == pytest.approx(0.0, abs=1e-300)  # no overflow


def test_yes_no_without_either_log_prob_is_transient() -> None:
    with pytest.raises(Transient, match="yes/no"):
        parse_yes_no({1: -0.1}, 5, 9)
    with pytest.raises(Transient, match="yes/no"):
        parse_yes_no({5: -math.inf, 9: -math.inf}, 5, 9)


def _judge(**overrides: object) -> GenerativeRMConfig:
    return GenerativeRMConfig(enable=True, path=str(asset_path("tokenizer")), **overrides)  # type: ignore[arg-type]


def test_yes_no_tokens_must_be_single_tokens_of_the_judges_tokenizer() -> None:
    # the shipped tokenizer splits "Yes" and "No" (2 tokens each) but has "Y" and "N"
    cfg = _judge(parser="yes_no")
    problems = judge_problems(cfg)
    assert len(problems) == 2 and all("yes_no_tokens" in p and "not one" in p for p in problems)
    with pytest.raises(ValueError, match="'Yes' is 2 tokens"):
        JudgeSource(cfg, ["http://127.0.0.1:1"])
    assert judge_problems(_judge(parser="yes_no", yes_no_tokens=["Y", "N"])) == []
    assert judge_problems(_judge(parser="number")) == []  # the tokens matter to yes_no only


def test_judge_problems_name_a_tokenizer_that_does_not_load_and_a_bad_template(tmp_path: Path) -> None:
    problems = judge_problems(GenerativeRMConfig(enable=True, path=str(tmp_path / "missing")))
    assert len(problems) == 1 and "tokenizer does not load" in problems[0]
    problems = judge_problems(_judge(prompt_template="{prompt} {response} \\boxed{x}"))
    assert len(problems) == 1 and "prompt_template does not format" in problems[0]
