"""Losses that force the divergence guards: a per-rank engine case, and a policy loss that `megarl-train` loads by
dotted path (`algorithm.policy_loss=cases.divergence_cases:nan_policy_loss`, with tests/ on PYTHONPATH)."""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from cases.megatron_cases import _trained_role
from megarl.algo.aggregation import LossNormalizer
from megarl.algo.policy_loss import PolicyLossInputs, ppo_loss
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.losses import MicroBatchLoss, PolicyLoss
from megarl.megatron.parallel import ParallelLayout
from megarl.megatron.weights import gather_hf_weights

POISONS = ("gradient", "loss", None)
"""The steps of `rank_poisoned_steps`: NaN gradients, a NaN loss with finite gradients, then a clean step."""


def nan_policy_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's token losses times NaN: every gradient is NaN, at every step."""
    loss, metrics = ppo_loss(inputs, cfg)
    return loss * float("nan"), metrics


@dataclass(frozen=True, slots=True)
class Poisoned:
    """`inner`'s loss made non-finite on global rank `rank` (every rank when None): `gradient` multiplies it by
    NaN (NaN gradients); `loss` adds a NaN constant (the loss is NaN, its gradients are not)."""

    inner: MicroBatchLoss
    poison: str | None
    rank: int | None = None
    needs_entropy: bool = False

    def __call__(
        self, micro: dict[str, Tensor], outputs: dict[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = self.inner(micro, outputs, normalizer)
        if self.rank is not None and dist.get_rank() != self.rank:
            return loss, metrics
        if self.poison == "gradient":
            return loss * float("nan"), metrics
        if self.poison == "loss":
            return loss + torch.tensor(float("nan")), metrics
        return loss, metrics


def rank_poisoned_steps(
    model_dir: Path, cases: list[tuple[str, ParallelLayout, bool, int | None]], batch: dict[str, Tensor]
) -> dict[str, dict]:
    """Per case (name, layout, distributed optimizer, poisoned rank): from the HF weights, one Adam step per entry
    of `POISONS`. Returns this rank's HF tensors before and after each step, each step's metrics, and the LR
    schedule's step count."""
    batching = MicroBatching(micro_batch_size=2)
    loss = PolicyLoss(AlgorithmConfig())
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    out = {}
    for name, role_layout, distributed, rank in cases:
        groups, model, trainable, engine, share = _trained_role(
            model_dir, role_layout, batch, batching, optim, distributed
        )
        weights, metrics = [gather_hf_weights(model, groups)], []
        for poison in POISONS:
            metrics.append(engine.train_step(share, batching, Poisoned(loss, poison, rank)))
            weights.append(gather_hf_weights(model, groups))
        out[name] = {"weights": weights, "metrics": metrics, "scheduler_steps": trainable.scheduler.num_steps}
    return out
