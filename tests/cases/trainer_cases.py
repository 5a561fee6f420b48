"""Plugins for the trainer tests, loaded by dotted path from the `megarl-train` subprocess."""

from typing import Any

from megarl.rewards import RewardResult


def varied_reward(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> RewardResult:
    """A score that differs between a random policy's samples (DAPO keeps groups only when it does), and two
    components that do too (GDPO's `algorithm.reward_weights`)."""
    extra = {"odd_length": len(solution_str) % 2, "has_digit": any(c.isdigit() for c in solution_str)}
    return RewardResult(float(sum(map(ord, solution_str)) % 3) / 2, extra)
