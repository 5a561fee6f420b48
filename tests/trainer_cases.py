"""Plugins for the trainer tests, loaded by dotted path from the `megarl-train` subprocess."""

from typing import Any

from megarl.rewards import RewardResult


def varied_reward(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> RewardResult:
    """A score that differs between a random policy's samples (DAPO keeps groups only when it does)."""
    return RewardResult(float(sum(map(ord, solution_str)) % 3) / 2)
