"""Reward of the synthetic addition task (megarl.data.arith): the first number in the response.

1.0 when it equals the answer, `format_score` when the response has a number but the wrong one,
0.0 when it has none; that number is the result's `answer`. The partial credit gives a random-init
policy a signal before it can add.
"""

import re
from typing import Any

from megarl.rewards.registry import RewardResult, register_reward

_NUMBER = re.compile(r"\d+")


@register_reward("megarl/arith")
def arith_reward(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, format_score: float = 0.1
) -> RewardResult:
    match = _NUMBER.search(solution_str)
    correct = match is not None and match.group() == ground_truth.strip()
    score = 1.0 if correct else (format_score if match else 0.0)
    answer = match.group() if match else None
    return RewardResult(score, {"acc": float(correct), "has_number": float(match is not None)}, answer)
