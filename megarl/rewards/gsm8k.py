"""GSM8K rule reward: compare the response's final number with the gold answer.

Two extraction methods (`reward.kwargs.method`):

- `strict`: the number right after the last `####` marker, the GSM8K answer format (`#### 72`).
  No marker, or no number after the last one, means no answer.
- `flexible`: the last number anywhere in the response.

A number may carry a sign and `$`, use commas as thousands separators and have decimals
(`-$1,234.5`); a sentence's closing period is not part of it. Only the last `TAIL_CHARS`
characters of a response are searched, as is common practice: the final answer sits at the end,
and long rambling responses cost no more to score than short ones.
"""

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from megarl.rewards.registry import RewardResult, register_reward

TAIL_CHARS = 300
METHODS = ("strict", "flexible")

# A minus sign right after a digit is a subtraction or a range ("3-4"), not a sign.
_NUMBER = r"(?:(?<![0-9])-\$?|\$-?)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?"
_NUMBER_RE = re.compile(_NUMBER)
_AFTER_MARKER_RE = re.compile(rf"[ \t]*({_NUMBER})")
_MARKER = "####"


def normalize_number(text: str) -> str:
    """Canonical text of a number: no whitespace, `$`, commas or trailing period (`" $1,000. "` → `"1000"`)."""
    return text.replace("$", "").replace(",", "").strip().rstrip(".").strip()


def _as_decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def answers_match(a: str, b: str) -> bool:
    """Equal as numbers when both parse (`"18.0"` == `"18"`), else as normalized text."""
    a, b = normalize_number(a), normalize_number(b)
    num_a, num_b = _as_decimal(a), _as_decimal(b)
    if num_a is not None and num_b is not None:
        return num_a == num_b
    return a == b


def gold_answer(answer_field: str) -> str:
    """The ground truth of a GSM8K `answer` field: the normalized text after its last `####`."""
    if _MARKER not in answer_field:
        raise ValueError(
            f"GSM8K answer field has no '#### N' final line: {answer_field[-80:]!r}; "
            "each row's `answer` must end with '#### <number>'"
        )
    gold = normalize_number(answer_field.split(_MARKER)[-1])
    if not gold:
        raise ValueError(f"GSM8K answer field has nothing after its '####': {answer_field[-80:]!r}")
    return gold


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The normalized final answer of a response, or None when it has none (see the module docstring)."""
    tail = text[-TAIL_CHARS:]
    if method == "strict":
        _, marker, after = tail.rpartition(_MARKER)
        match = _AFTER_MARKER_RE.match(after) if marker else None
        return normalize_number(match.group(1)) if match else None
    if method == "flexible":
        numbers = _NUMBER_RE.findall(tail)
        return normalize_number(numbers[-1]) if numbers else None
    raise ValueError(f"method={method!r} is unknown; set reward.kwargs.method to one of {', '.join(METHODS)}")


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
    """`score` for the right answer, `format_score` for a wrong one, 0.0 when no answer was found.

    `answer` is the extracted answer (None when none was found); `extra` holds `format_ok` (an
    answer was found) and `acc` (it matches `ground_truth`).
    """
    pred = extract_answer(solution_str, method)
    correct = pred is not None and answers_match(pred, ground_truth)
    if correct:
        value = score
    elif pred is not None:
        value = format_score
    else:
        value = 0.0
    return RewardResult(score=value, extra={"format_ok": pred is not None, "acc": correct}, answer=pred)
