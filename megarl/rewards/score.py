"""Trajectory scores on the driver: the rule reward of each row's data_source, or the agent loop's reward.

A row whose agent loop produced a reward (`loop_reward` is not None: a tool or an interaction judged
it) is scored by that reward; every other row by `get_reward_fn(data_source, reward.function)` on the
response text the agent worker produced with the tokens (`response_text`, `agents.postprocess`).
`RewardResult.extra`'s numeric values become `reward/<name>/mean` metrics and each row's `reward_extra`
(GDPO's reward components).
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megarl.batch import Batch
from megarl.config.trainer import RewardConfig
from megarl.rewards import RewardResult, get_reward_fn


def score_each(batch: Batch, cfg: RewardConfig) -> list[RewardResult]:
    """Each finished trajectory's result: its agent loop's reward (no extra, no answer) when it has one,
    else its reward function's on the row's `response_text`."""
    responses = batch["response_text"]
    loop_rewards = batch["loop_reward"] if "loop_reward" in batch else [None] * len(batch)
    results = []
    for i, (response, loop_reward) in enumerate(zip(responses, loop_rewards, strict=True)):
        if loop_reward is not None:
            results.append(RewardResult(float(loop_reward)))
            continue
        source = str(batch["data_source"][i])
        truth = str((batch["reward_model"][i] or {}).get("ground_truth", ""))
        results.append(get_reward_fn(source, cfg.function)(response, truth, batch["extra_info"][i], **cfg.kwargs))
    return results


class HasScored(Protocol):
    @property
    def scored(self) -> "Scored": ...


@dataclass(frozen=True, slots=True)
class Scored:
    scores: torch.Tensor
    """[b] float32."""
    metrics: dict[str, float]
    """`reward/<name>/mean` of the numeric extras."""
    extras: list[dict[str, float]]
    """Each row's numeric `RewardResult.extra` (empty for a row scored by its agent loop)."""

    @staticmethod
    def of(batch: Batch) -> "Scored":
        """What `record` left in `batch` (rows scored before: dynamic sampling, saved rollouts)."""
        extras = list(batch["reward_extra"]) if "reward_extra" in batch else [{} for _ in range(len(batch))]
        return Scored(batch["scores"], {}, extras)

    @staticmethod
    def concat(parts: Sequence["HasScored"]) -> "Scored":
        """The scores of several scored row sets (asynchronous groups), in order, metrics over all rows."""
        extras = [row for part in parts for row in part.scored.extras]
        scores = torch.cat([part.scored.scores for part in parts])
        return Scored(scores, extra_metrics(extras), extras)

    def record(self, batch: Batch) -> None:
        """`scores` and `reward_extra` columns of `batch`."""
        batch.set("scores", self.scores)
        batch.set("reward_extra", self.extras)


def score_batch(batch: Batch, cfg: RewardConfig) -> Scored:
    """Scores, metrics and numeric extras of finished trajectories."""
    results = score_each(batch, cfg)
    scores = torch.tensor([float(result.score) for result in results], dtype=torch.float32)
    extras = [
        {key: float(value) for key, value in result.extra.items() if isinstance(value, int | float | bool)}
        for result in results
    ]
    return Scored(scores, extra_metrics(extras), extras)


def extra_metrics(extras: list[dict[str, float]]) -> dict[str, float]:
    """`reward/<name>/mean` of each numeric extra over the rows that have it."""
    by_key: dict[str, list[float]] = defaultdict(list)
    for row in extras:
        for key, value in row.items():
            by_key[key].append(value)
    return {f"reward/{key}/mean": float(np.mean(values)) for key, values in by_key.items()}


def reward_components(extras: list[dict[str, float]], weights: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(components `[b, K]`, weights `[K]`) in `weights`' order, from each row's numeric reward extras."""
    names = list(weights)
    for i, row in enumerate(extras):
        missing = [name for name in names if name not in row]
        if missing:
            raise ValueError(
                f"algorithm.reward_weights names {missing}, but row {i}'s reward has extras {sorted(row)} "
                "(a row scored by its agent loop has none); return them in RewardResult.extra or change the weights"
            )
    components = torch.tensor([[row[name] for name in names] for row in extras], dtype=torch.float32)
    return components.reshape(len(extras), len(names)), torch.tensor([weights[n] for n in names], dtype=torch.float32)
