"""Policy losses, chosen by `algorithm.policy_loss`, and the actor's total loss.

A policy loss has the signature `fn(inputs: PolicyLossInputs, cfg: AlgorithmConfig) ->
(token_loss [b, t], metrics)`; aggregation (`aggregation.py`) and the rollout correction
(`rollout_correction.py`) are applied around it by `policy_loss`, so a user's loss gets both for free.

- `ppo`: r_t = π/π_old, ℓ_t = max(−A·r_t, −A·clip(r_t, 1 − clip_ratio_low, 1 + clip_ratio_high)),
  and for A < 0 dual-clip ℓ_t ← min(ℓ_t, −A·clip_ratio_c).
- `gspo`: sequence ratio s_i = exp(mean_t log r_it), applied per token as
  s_it = sg(s_i)·π/sg(π) (same value, token gradients), clipped like PPO (with GSPO's small
  clip ratios, e.g. 3e-4 / 4e-4, and `seq-mean-token-mean` aggregation; see configs/algorithm/gspo.yaml).
- More losses, registered by their own modules (imported by `megarl.algo`): `cispo`, `sapo`, `gmpo`,
  `dppo_tv`, `dppo_kl` (policy_losses_ratio.py), `clip_cov`, `kl_cov` (policy_losses_cov.py), `gpg`,
  `dro`, `bypass` (policy_losses_pg.py); their hyperparameters are `algorithm.loss_params.*`.
- Rollout correction (`algorithm.rollout_correction`, or its shorthand `rollout_is_cap`): when the rollout
  engine's log-probs differ from the trainer's, each token loss is multiplied by a detached weight built
  from π_old/π_rollout (token, sequence or geometric level; truncated, or masked/rejected with the
  rejected tokens leaving the sum); `rollout_is_cap=C` is the token-level w_t = min(π_old/π_rollout, C).

Metrics (token means): `pg_clipfrac_high` (A > 0, r > 1 + high), `pg_clipfrac_low` (A < 0,
r < 1 − low), `pg_clipfrac_dual` (dual clip active), `ppo_kl` (mean of log π_old − log π); with the
rollout correction on, its `rollout_corr/*` metrics (and, for `rollout_is_cap`, `rollout_is_weight_mean` /
`rollout_is_capped_frac`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.algo.aggregation import LossNormalizer, aggregate_loss, loss_normalizer
from megarl.algo.kl import kl_penalty
from megarl.algo.registry import Registry
from megarl.algo.rollout_correction import resolve_rollout_correction, rollout_correction
from megarl.algo.stats import masked_mean

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±this before exp, so one wild token cannot overflow."""


@dataclass(frozen=True, slots=True)
class PolicyLossInputs:
    log_prob: Tensor
    """[b, t] log π of the response tokens under the current policy (with grad)."""
    old_log_prob: Tensor
    """[b, t] log π_old recomputed by the trainer before the update."""
    advantages: Tensor
    """[b, t]"""
    response_mask: Tensor
    """[b, t] 1 = model token."""
    rollout_log_prob: Tensor | None = None
    """[b, t] log-probs the rollout engine reported (the behaviour policy of rollout correction and bypass)."""
    rollout_is_batch_mean: Tensor | None = None
    """[b] the rollout-correction weights' mean over the whole batch (`rollout_correction.batch_normalize`); None:
    these rows are the whole batch."""


PolicyLossFn = Callable[[PolicyLossInputs, "AlgorithmConfig"], tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("algorithm.policy_loss")


def clamped_log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """log π − log π_old `[b, t]`, clamped to ±MAX_LOG_RATIO (safe to exp)."""
    return (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def clipped_objective(
    ratio: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's max(−A·r, −A·clip(r)) `[b, t]` with the high/low clip fractions."""
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
    metrics = {
        "pg_clipfrac_high": masked_mean(((advantages > 0) & (ratio > high)).float(), mask),
        "pg_clipfrac_low": masked_mean(((advantages < 0) & (ratio < low)).float(), mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("ppo")
def ppo_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with separate low/high ratios and dual-clip for negative advantages."""
    mask = inputs.response_mask.float()
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    loss, metrics = clipped_objective(log_ratio.exp(), inputs.advantages, mask, cfg)
    dual_bound = -inputs.advantages * cfg.clip_ratio_c
    dual = (inputs.advantages < 0) & (loss > dual_bound)
    metrics["pg_clipfrac_dual"] = masked_mean(dual.float(), mask)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    return torch.where(dual, dual_bound, loss), metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped objective on the length-normalised sequence ratio (token-gradient form)."""
    mask = inputs.response_mask.float()
    log_ratio = inputs.log_prob - inputs.old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [b, 1]
    token_log_ratio = seq_log_ratio.detach() + inputs.log_prob - inputs.log_prob.detach()
    ratio = token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    loss, metrics = clipped_objective(ratio, inputs.advantages, mask, cfg)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    return loss, metrics


def policy_loss(
    inputs: PolicyLossInputs, cfg: AlgorithmConfig, normalizer: LossNormalizer | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """`cfg.policy_loss` token losses, weighted and masked by the rollout correction when on, aggregated.

    The normaliser's token and sequence counts come from `inputs.response_mask` (as the worker's mini-batch
    normaliser's do), so rejected tokens add 0 but still count there; seq-mean-token-mean averages each
    sequence over its kept tokens.
    """
    token_loss, metrics = POLICY_LOSSES.get(cfg.policy_loss)(inputs, cfg)
    correction = resolve_rollout_correction(cfg)
    if correction is None:
        return aggregate_loss(token_loss, inputs.response_mask, cfg.loss_agg_mode, normalizer), metrics
    if inputs.rollout_log_prob is None:
        key = "rollout_is_cap" if cfg.rollout_is_cap is not None else "rollout_correction.level"
        raise ValueError(
            f"algorithm.{key} is set but the batch has no rollout log-probs; the rollout must return them, "
            f"or turn it off (algorithm.rollout_is_cap=null, algorithm.rollout_correction.level=none)"
        )
    weights, mask, corr_metrics = rollout_correction(
        inputs.old_log_prob, inputs.rollout_log_prob, inputs.response_mask, correction, inputs.rollout_is_batch_mean
    )
    metrics |= corr_metrics
    if cfg.rollout_is_cap is not None:  # the shorthand keeps its historical metric names
        metrics["rollout_is_weight_mean"] = corr_metrics["rollout_corr/weight_mean"]
        metrics["rollout_is_capped_frac"] = corr_metrics["rollout_corr/truncated_frac"]
    norm = normalizer if normalizer is not None else loss_normalizer([inputs.response_mask])
    return aggregate_loss(token_loss * weights, mask, cfg.loss_agg_mode, norm), metrics


def actor_loss(
    inputs: PolicyLossInputs,
    cfg: AlgorithmConfig,
    normalizer: LossNormalizer | None = None,
    entropy: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """policy loss − entropy_coeff·agg(H) + kl_loss_coef·agg(kl(π, π_ref)) when use_kl_loss.

    `entropy` `[b, t]` is needed when entropy_coeff ≠ 0 and `ref_log_prob` `[b, t]` when use_kl_loss.
    """
    loss, metrics = policy_loss(inputs, cfg, normalizer)
    metrics["pg_loss"] = loss.detach()
    if entropy is not None:
        entropy_term = aggregate_loss(entropy, inputs.response_mask, cfg.loss_agg_mode, normalizer)
        metrics["entropy"] = entropy_term.detach()
        loss = loss - cfg.entropy_coeff * entropy_term
    elif cfg.entropy_coeff != 0:
        raise ValueError("algorithm.entropy_coeff != 0 needs the token entropy of the policy")
    if cfg.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("algorithm.use_kl_loss=true needs reference log-probs")
        kl_mat = kl_penalty(inputs.log_prob, ref_log_prob, cfg.kl_loss_type, inputs.response_mask)
        kl_term = aggregate_loss(kl_mat, inputs.response_mask, cfg.loss_agg_mode, normalizer)
        metrics["kl_loss"] = kl_term.detach()
        loss = loss + cfg.kl_loss_coef * kl_term
    return loss, metrics
