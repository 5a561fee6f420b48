"""Plain policy-gradient losses: GPG, DRO and the rollout-log-prob "bypass" REINFORCE.

Registered in `POLICY_LOSSES` (`algorithm.policy_loss=<name>`), hyperparameters in
`algorithm.loss_params` (p below); sg = stop-gradient.

- `gpg`:    ℓ_t = −A_t·log π_t                                            (no ratio, no clip)
- `dro`:    ℓ_t = −A_t·log π_t + ½·p.dro_beta·(log π_t − log π_old,t)²
- `bypass`: ℓ_t = −sg(w_t)·A_t·log π_t with ρ_t = π_t/π_rollout,t (p.bypass_is_level=token), its sequence's
            Π_t ρ_t (sequence) or (Π_t ρ_t)^(1/|y|) (geometric); w = min(ρ, p.bypass_is_cap) (no weight when the cap
            is None), or with p.bypass_is_lower the IcePop band w = ρ if lower <= ρ <= cap else 0

`bypass` takes the rollout engine's log-probs as the behaviour policy and never reads π_old, so the
trainer's recomputed log-probs are not needed by the loss. Metrics: `ppo_kl` = mean(log π_old − log π)
(bypass: mean(log π_rollout − log π)), `rollout_is_weight_mean` and `rollout_is_capped_frac` (bypass; with IcePop
`rollout_is_masked_frac`, the share of model tokens given weight 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.algo.policy_loss import POLICY_LOSSES, PolicyLossInputs, clamped_log_ratio
from megarl.algo.rollout_correction import level_ratio
from megarl.algo.stats import masked_mean, zero_outside

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig, PolicyLossParams

SKIPS_OLD_LOG_PROBS = frozenset({"bypass"})
"""Losses that never read π_old: the trainer does not recompute it for them (old_log_probs := rollout_log_probs)."""


@POLICY_LOSSES.register("gpg")
def gpg_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (arXiv 2504.02546; verl core_algos.compute_policy_loss_gpg): the policy gradient −A·log π itself."""
    log_ratio = inputs.log_prob.detach() - inputs.old_log_prob
    return -inputs.advantages * inputs.log_prob, {"ppo_kl": masked_mean(-log_ratio, inputs.response_mask.float())}


@POLICY_LOSSES.register("dro")
def dro_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO as verl v0.9.0 defines it (core_algos.compute_policy_loss_dro, docs/algo/dro.md): −A·log π with a
    quadratic penalty on the log-ratio to π_old, weighted by `loss_params.dro_beta`."""
    beta = cfg.loss_params.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"algorithm.policy_loss=dro needs algorithm.loss_params.dro_beta > 0 (got {beta}), e.g. 0.05")
    log_ratio = inputs.log_prob - inputs.old_log_prob
    metrics = {"ppo_kl": masked_mean(-log_ratio.detach(), inputs.response_mask.float())}
    return -inputs.advantages * inputs.log_prob + 0.5 * beta * log_ratio.square(), metrics


@POLICY_LOSSES.register("bypass")
def bypass_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE on the rollout's samples with the rollout engine's log-probs as the behaviour policy and a
    truncated, detached token IS weight (verl core_algos.compute_policy_loss_bypass_mode with
    loss_type=reinforce, compute_policy_loss_reinforce)."""
    if inputs.rollout_log_prob is None:
        raise ValueError(
            "algorithm.policy_loss=bypass trains on the rollout engine's log-probs but the batch has none; "
            "the rollout must return them (rollout_log_probs), or choose another algorithm.policy_loss"
        )
    if cfg.rollout_is_cap is not None:
        raise ValueError(
            "algorithm.policy_loss=bypass already weights by π/π_rollout (algorithm.loss_params.bypass_is_cap); "
            "set algorithm.rollout_is_cap=null"
        )
    params, mask = cfg.loss_params, inputs.response_mask.float()
    log_ratio = zero_outside(clamped_log_ratio(inputs.log_prob, inputs.rollout_log_prob).detach(), mask)
    metrics = {"ppo_kl": masked_mean(-log_ratio, mask)}
    if params.bypass_is_cap is None:
        return -inputs.advantages * inputs.log_prob, metrics
    weight, metrics["rollout_is_weight_mean"], frac = bypass_weights(log_ratio, mask, params)
    metrics["rollout_is_masked_frac" if params.bypass_is_lower is not None else "rollout_is_capped_frac"] = frac
    return -weight * inputs.advantages * inputs.log_prob, metrics


def bypass_weights(log_ratio: Tensor, mask: Tensor, params: PolicyLossParams) -> tuple[Tensor, Tensor, Tensor]:
    """(w `[b, t]`, mean w, share of model tokens truncated or, with IcePop, given weight 0) from the token
    log-ratios to the rollout `[b, t]` (0 off the mask): truncated at the cap, or 0 outside [lower, cap]."""
    assert params.bypass_is_cap is not None
    ratio, cap = level_ratio(log_ratio, mask, params.bypass_is_level), params.bypass_is_cap
    if params.bypass_is_lower is None:
        weight, out = ratio.clamp(max=cap), ratio > cap
    else:
        out = (ratio < params.bypass_is_lower) | (ratio > cap)
        weight = torch.where(out, 0.0, ratio)
    return weight, masked_mean(weight, mask), masked_mean(out.float(), mask)
