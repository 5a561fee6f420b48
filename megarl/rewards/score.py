"""Trajectory scores as the trainer reads them: what the agent workers' reward pipeline left in the rollout batch.

Each rollout row arrives scored (`megarl.scoring.pipeline`): `scores`, `reward_extra` (the rule function's numeric
extras and, with model rewards, each component by name: GDPO's reward components), `reward_answer` (validation's
maj@k) and `reward_stats` (latency, retries, errors, skipped). `Scored.of_rollout` turns them into the step's
scores and `reward/…` metrics, and takes rows skipped under `reward_model.on_error=skip_sample` out of training.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from megarl.batch import Batch


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
    stats: list[dict[str, float]] = field(default_factory=list)
    """Each row's scoring latency, retries, errors and skip (empty for rows scored before)."""

    @staticmethod
    def of(batch: Batch) -> "Scored":
        """What `record` left in `batch` (rows scored before: dynamic sampling, saved rollouts)."""
        extras = list(batch["reward_extra"]) if "reward_extra" in batch else [{} for _ in range(len(batch))]
        return Scored(batch["scores"], {}, extras)

    @staticmethod
    def of_rollout(batch: Batch) -> "Scored":
        """The scores the agent workers recorded in a rollout `batch`, and their metrics; a skipped row (a source failed
        under on_error=skip_sample) gets its response mask zeroed here and its group's mean score (0 in a group of
        skipped rows only), so it moves neither the policy nor its group's baseline much."""
        extras, stats = list(batch["reward_extra"]), list(batch["reward_stats"])
        scores = batch["scores"].clone()
        skipped = torch.tensor([bool(row["skipped"]) for row in stats], dtype=torch.bool)
        if skipped.any():
            scores = _skip(batch, scores, skipped)
        return Scored(scores, extra_metrics(extras) | stats_metrics(stats), extras, stats)

    @staticmethod
    def concat(parts: Sequence["HasScored"]) -> "Scored":
        """The scores of several scored row sets (asynchronous groups), in order, metrics over all rows."""
        extras = [row for part in parts for row in part.scored.extras]
        stats = [row for part in parts for row in part.scored.stats]
        scores = torch.cat([part.scored.scores for part in parts])
        return Scored(scores, extra_metrics(extras) | (stats_metrics(stats) if stats else {}), extras, stats)

    def with_component(self, name: str, values: torch.Tensor, weight: float) -> "Scored":
        """These scores plus `weight` × `values` (a component scored after rollout: the Megatron RM), each row's
        value kept in its extras as `name`."""
        extras = [row | {name: float(value)} for row, value in zip(self.extras, values.tolist(), strict=True)]
        scores = self.scores + weight * values.to(self.scores.dtype)
        return Scored(scores, self.metrics | extra_metrics([{name: e[name]} for e in extras]), extras, self.stats)

    def record(self, batch: Batch) -> None:
        """`scores` and `reward_extra` columns of `batch`."""
        batch.set("scores", self.scores)
        batch.set("reward_extra", self.extras)


def _skip(batch: Batch, scores: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
    """Zero the skipped rows' response masks; their scores become the mean of their uid group's scored rows."""
    batch.set("response_mask", batch["response_mask"].masked_fill(skipped[:, None], 0))
    uids = np.asarray(batch["uid"], dtype=str)
    for i in np.flatnonzero(skipped.numpy()):
        peers = torch.from_numpy(uids == uids[i]) & ~skipped
        scores[i] = scores[peers].mean() if peers.any() else 0.0
    return scores


def stats_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """`reward/errors`, `reward/retries`, `reward/skipped` (counts over the rows) and the scoring latency's p50/p99."""
    latency = np.asarray([row["latency_s"] for row in stats], dtype=np.float64)
    totals = {key: float(sum(row[key] for row in stats)) for key in ("errors", "retries", "skipped")}
    return {f"reward/{key}": value for key, value in totals.items()} | {
        "reward/latency_p50": float(np.percentile(latency, 50)) if len(latency) else 0.0,
        "reward/latency_p99": float(np.percentile(latency, 99)) if len(latency) else 0.0,
    }


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
