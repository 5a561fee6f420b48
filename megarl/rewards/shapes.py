"""Reward of the shapes task (megarl.data.shapes): 1.0 when the first colour word in the response is the answer,
`format_score` when it is another colour, 0.0 when the response names none; that word is the result's `answer`
(the scoring of megarl.rewards.largest, with colour words for numbers)."""

import re
from typing import Any

from megarl.rewards.registry import RewardResult, register_reward

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "cyan", "pink")
"""The palette's names, the only answers the task asks for."""
_COLOUR = re.compile(rf"\b({'|'.join(COLOURS)})\b", re.IGNORECASE)


@register_reward("megarl/shapes")
def shapes_reward(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, format_score: float = 0.0
) -> RewardResult:
    match = _COLOUR.search(solution_str)
    answer = match.group().lower() if match else None
    correct = answer == ground_truth.strip().lower()
    score = 1.0 if correct else (format_score if match else 0.0)
    return RewardResult(score, {"acc": float(correct), "has_colour": float(match is not None)}, answer)
