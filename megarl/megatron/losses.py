"""Per-micro-batch losses the engine calls on the last pipeline stage: policy (actor), value (critic) and the
supervised cross-entropy (the actor in SFT).

Batch columns (all `[b, r]`, aligned with `responses`): `response_mask`, `old_log_probs`,
`advantages`, optional `rollout_log_probs` and `ref_log_probs` for the actor (and `[b]`
`rollout_is_batch_mean` with `algorithm.rollout_correction.batch_normalize`); `values` (old)
and `returns` for the critic.
"""

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from megarl.algo.aggregation import LossNormalizer, aggregate_loss
from megarl.algo.policy_loss import PolicyLossInputs, actor_loss
from megarl.algo.value_loss import value_loss
from megarl.config.algorithm import AlgorithmConfig


class MicroBatchLoss(Protocol):
    @property
    def needs_entropy(self) -> bool:
        """The loss reads `outputs["entropy"]`."""
        ...

    def __call__(
        self, micro: dict[str, Tensor], outputs: dict[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss with grad, detached metrics) of one micro-batch; summed over micro-batches = mini-batch loss."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    cfg: AlgorithmConfig

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coeff != 0

    def __call__(
        self, micro: dict[str, Tensor], outputs: dict[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = PolicyLossInputs(
            log_prob=outputs["log_probs"],
            old_log_prob=micro["old_log_probs"],
            advantages=micro["advantages"],
            response_mask=micro["response_mask"],
            rollout_log_prob=micro.get("rollout_log_probs"),
            rollout_is_batch_mean=micro.get("rollout_is_batch_mean"),
        )
        return actor_loss(
            inputs,
            self.cfg,
            normalizer,
            entropy=outputs["entropy"] if self.needs_entropy else None,
            ref_log_prob=micro.get("ref_log_probs") if self.cfg.use_kl_loss else None,
        )


@dataclass(frozen=True, slots=True)
class ValueLoss:
    cliprange_value: float
    loss_agg_mode: str
    needs_entropy: bool = False

    def __call__(
        self, micro: dict[str, Tensor], outputs: dict[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = value_loss(
            outputs["values"],
            micro["values"],
            micro["returns"],
            micro["response_mask"],
            self.cliprange_value,
            self.loss_agg_mode,
            normalizer,
        )
        metrics["vf_loss"] = loss.detach()
        return loss, metrics


@dataclass(frozen=True, slots=True)
class SFTLoss:
    """Cross-entropy on the tokens of `response_mask` (the assistant's), averaged over every such token of the
    mini-batch (all micro-batches and DP ranks): transformers' masked `CrossEntropyLoss` of the whole batch."""

    needs_entropy: bool = False

    def __call__(
        self, micro: dict[str, Tensor], outputs: dict[str, Tensor], normalizer: LossNormalizer
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss = aggregate_loss(-outputs["log_probs"], micro["response_mask"], "token-mean", normalizer)
        return loss, {}
