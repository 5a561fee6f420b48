"""Ratio-based policy losses beyond PPO: CISPO, SAPO, GMPO and DPPO's two divergence trust regions.

Each is registered in `POLICY_LOSSES` under its config name (`algorithm.policy_loss=<name>`) and reads
its hyperparameters from `algorithm.loss_params` (p below). r_t = π/π_old per token (log-ratio clamped
to ±20), sg = stop-gradient, m = response mask.

- `cispo`: ℓ_t = −sg(clip(r_t, 1 − p.cispo_clip_ratio_low, 1 + p.cispo_clip_ratio_high))·A_t·log π_t
- `sapo`:  ℓ_t = −f(r_t, τ_t)·A_t, f(r, τ) = 4/τ·σ(τ(r − 1)), τ_t = p.sapo_tau_pos if A_t > 0 else p.sapo_tau_neg
- `gmpo`:  ℓ_i = −Â_i·exp(mean_t c_it) on every token of sequence i, with Â_i = mean_t A_it and
  c_it = sgn(Â_i)·min(sgn(Â_i)·log r_it, sgn(Â_i)·clip(log r_it, −ε_low, ε_high)), ε = p.gmpo_log_clip[_low|_high]
- `dppo_tv` / `dppo_kl`: ℓ_t = −A_t·sg(min(r_t, p.dppo_ratio_cap))·log π_t·v_t, v_t = 1 inside the trust
  region of the sampled token's probability (TV: π − π_old, KL: binary KL(π_old ‖ π)), else 0; the region's
  bound is δ_high for A > 0 and δ_low for A <= 0 (p.dppo_*_delta_high / _low, each null = p.dppo_*_delta).

Metrics (token means over m): `pg_clipfrac_high` / `pg_clipfrac_low` (the upper / lower clip or the
trust region is active), `ppo_kl` = mean(log π_old − log π), `sapo_gate_weight` (SAPO's gradient
weight 4σ(1 − σ), 1 on-policy), `dppo_ratio_capped_frac`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.algo.policy_loss import POLICY_LOSSES, PolicyLossInputs, clamped_log_ratio
from megarl.algo.stats import masked_mean

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig

BINARY_KL_EPS = 1e-8
"""Keeps log(1 − π) finite for tokens of probability 1 (binary KL of DPPO)."""


@POLICY_LOSSES.register("cispo")
def cispo_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585; verl core_algos.compute_policy_loss_cispo): REINFORCE weighted by
    the clipped, detached IS weight, so every token keeps a gradient (PPO's clip drops them)."""
    params, mask = cfg.loss_params, inputs.response_mask.float()
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    ratio = log_ratio.detach().exp()
    low = None if params.cispo_clip_ratio_low is None else 1.0 - params.cispo_clip_ratio_low
    weight = ratio.clamp(min=low, max=1.0 + params.cispo_clip_ratio_high)
    metrics = {
        "pg_clipfrac_high": masked_mean((ratio > weight).float(), mask),
        "pg_clipfrac_low": masked_mean((ratio < weight).float(), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return -weight * inputs.advantages * inputs.log_prob, metrics


@POLICY_LOSSES.register("sapo")
def sapo_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, arXiv 2511.20347; verl core_algos.compute_policy_loss_sapo): a smooth sigmoid gate of the
    ratio instead of the hard clip; its gradient weight 4σ(1 − σ) is 1 at r = 1 and fades away from it,
    faster for negative advantages (τ_neg > τ_pos). Meant for `seq-mean-token-mean` (algorithm=sapo)."""
    params, mask = cfg.loss_params, inputs.response_mask.float()
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    tau = torch.where(inputs.advantages > 0, params.sapo_tau_pos, params.sapo_tau_neg)
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0))
    metrics = {
        "sapo_gate_weight": masked_mean(4.0 * gate.detach() * (1.0 - gate.detach()), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return -(4.0 / tau) * gate * inputs.advantages, metrics


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (arXiv 2507.20673; verl core_algos.compute_policy_loss_geo_mean, there named `geo_mean`): the
    sequence objective Â_i·(Π_t r_it)^(1/|y_i|), each token ratio clipped pessimistically in log space.

    The sequence loss is put on every model token of the sequence, so `seq-mean-token-mean` (algorithm=gmpo)
    averages the sequence losses; the advantage is the sequence's mean token advantage (outcome rewards)."""
    params, mask = cfg.loss_params, inputs.response_mask.float()
    low, high = bounds(params.gmpo_log_clip, params.gmpo_log_clip_low, params.gmpo_log_clip_high)
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    seq_adv = masked_mean(inputs.advantages, mask, dim=-1).unsqueeze(-1)  # [b, 1]
    sign = seq_adv.sign()
    clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-low, high))
    seq_loss = -seq_adv * masked_mean(clipped, mask, dim=-1).unsqueeze(-1).exp()  # [b, 1]
    metrics = {
        "pg_clipfrac_high": masked_mean(((sign > 0) & (log_ratio > high)).float(), mask),
        "pg_clipfrac_low": masked_mean(((sign < 0) & (log_ratio < -low)).float(), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return seq_loss.expand_as(log_ratio), metrics


def bounds(symmetric: float, low: float | None, high: float | None) -> tuple[float, float]:
    """(low, high): each asymmetric bound, or the symmetric one where it is null."""
    return (symmetric if low is None else low), (symmetric if high is None else high)


def _binary_kl(old_log_prob: Tensor, log_prob: Tensor) -> Tensor:
    """KL(Bernoulli(π_old) ‖ Bernoulli(π)) of the sampled token, elementwise."""
    old_prob, prob = old_log_prob.exp(), log_prob.exp()
    rest = torch.log(1.0 - old_prob + BINARY_KL_EPS) - torch.log(1.0 - prob + BINARY_KL_EPS)
    return old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * rest


def _dppo(inputs: PolicyLossInputs, cfg: AlgorithmConfig, inside: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPPO loss given `inside` `[b, t]` (bool, no grad): the token is in the trust region for its advantage."""
    mask, cap = inputs.response_mask.float(), cfg.loss_params.dppo_ratio_cap
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    ratio = log_ratio.detach().exp()
    loss = -inputs.advantages * ratio.clamp(max=cap) * inputs.log_prob * inside.float()
    metrics = {
        "pg_clipfrac_high": masked_mean(((inputs.advantages > 0) & ~inside).float(), mask),
        "pg_clipfrac_low": masked_mean(((inputs.advantages < 0) & ~inside).float(), mask),
        "dppo_ratio_capped_frac": masked_mean(((ratio > cap) & inside).float(), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879; verl core_algos.compute_policy_loss_dppo_tv): a token is dropped when
    its probability moved more than δ in the direction its advantage pushes: δ_high up for A > 0, δ_low down
    for A <= 0 (`dppo_tv_delta_high` / `_low`, each null = `dppo_tv_delta`)."""
    params = cfg.loss_params
    low, high = bounds(params.dppo_tv_delta, params.dppo_tv_delta_low, params.dppo_tv_delta_high)
    change = inputs.log_prob.detach().exp() - inputs.old_log_prob.exp()
    inside = torch.where(inputs.advantages > 0, change <= high, change >= -low)
    return _dppo(inputs, cfg, inside)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879; verl core_algos.compute_policy_loss_dppo_kl): a token is dropped when
    the binary KL of its probability exceeds δ and it moved the way its advantage pushes: δ_high for A > 0,
    δ_low for A <= 0 (`dppo_kl_delta_high` / `_low`, each null = `dppo_kl_delta`)."""
    params, log_prob = cfg.loss_params, inputs.log_prob.detach()
    low, high = bounds(params.dppo_kl_delta, params.dppo_kl_delta_low, params.dppo_kl_delta_high)
    kl = _binary_kl(inputs.old_log_prob, log_prob)
    down, up = log_prob <= inputs.old_log_prob, log_prob >= inputs.old_log_prob
    inside = torch.where(inputs.advantages > 0, (kl <= high) | down, (kl <= low) | up)
    return _dppo(inputs, cfg, inside)
