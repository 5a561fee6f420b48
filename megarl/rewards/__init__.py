"""Reward functions selected by the rows' `data_source` (see `registry`)."""

from megarl.rewards import arith, gsm8k, largest, shapes
from megarl.rewards.registry import (
    RewardFn,
    RewardResult,
    get_reward_fn,
    known_data_sources,
    register_reward,
)

__all__ = [
    "RewardFn",
    "RewardResult",
    "arith",
    "get_reward_fn",
    "gsm8k",
    "known_data_sources",
    "largest",
    "register_reward",
    "shapes",
]
