"""Reward of the largest-number task (megarl.data.largest): 1.0 when the first number in the response
is the answer, else 0.0 (the scoring of megarl.rewards.arith, without partial credit)."""

from typing import Any

from megarl.rewards.arith import arith_reward
from megarl.rewards.registry import RewardResult, register_reward


@register_reward("megarl/largest")
def largest_reward(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, format_score: float = 0.0
) -> RewardResult:
    return arith_reward(solution_str, ground_truth, extra_info, format_score)
