"""GSM8K rule reward: compare the model's final number with the gold answer.

Two extraction modes:

- `strict`: the number after the last `#### ` marker (the GSM8K answer format); none → no answer.
- `flexible`: the last number anywhere in the response.

Only the last 300 characters of a response are searched: final answers sit at the end, and
long rambling responses then cost nothing extra.
"""

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from megarl.rewards.registry import RewardResult, register_reward

TAIL_CHARS = 300
_STRICT = re.compile(r"#### *(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]")
METHODS = ("strict", "flexible")


def normalize_number(text: str) -> str:
    """Canonical text of a number: no spaces, `$`, commas or trailing period (`"$1,000."` → `"1000"`)."""
    return text.strip().replace("$", "").replace(",", "").rstrip(".")


def answers_match(a: str, b: str) -> bool:
    """Equal as numbers when both parse (`"18.0"` == `"18"`), else as normalized text."""
    a, b = normalize_number(a), normalize_number(b)
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gold_answer(answer_field: str) -> str:
    """The ground truth of a GSM8K `answer` field: the normalized number after its `####`."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '#### N' final line: {answer_field[-80:]!r}")
    return normalize_number(answer_field.split("####")[-1])


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The response's final answer, normalized, or None when it has none."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of {', '.join(METHODS)} (reward.kwargs.method)")
    tail = text[-TAIL_CHARS:]
    pattern = _STRICT if method == "strict" else _NUMBER
    matches = [normalize_number(m) for m in pattern.findall(tail)]
    matches = [m for m in matches if m.strip("-.")]
    return matches[-1] if matches else None


@register_reward("openai/gsm8k", "gsm8k")
def compute_score(
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> RewardResult:
    """`score` for the right answer, `format_score` for a wrong one, 0 when no answer was found."""
    pred = extract_answer(solution_str, method)
    correct = pred is not None and answers_match(pred, ground_truth)
    value = score if correct else (format_score if pred is not None else 0.0)
    return RewardResult(score=value, extra={"pred": pred, "format_ok": pred is not None, "acc": correct})
