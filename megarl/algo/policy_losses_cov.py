"""Entropy-preserving policy losses: Clip-Cov and KL-Cov.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv
2505.22617; verl core_algos.compute_policy_loss_clip_cov / compute_policy_loss_kl_cov): entropy falls
when tokens whose log-probability and advantage covary strongly are pushed further, so both losses
restrain a few such tokens of each micro-batch. The per-token covariance, over the N model tokens of
the micro-batch (means over model tokens, no gradient), is

    cov_t = (A_t − mean A)·(log π_t − mean log π)

- `clip_cov`: PPO's clipped loss (`clip_ratio_low` / `clip_ratio_high`, no dual clip); among the model
  tokens PPO did not clip with `loss_params.clip_cov_lb` < cov_t < `clip_cov_ub`, a random
  max(⌊`clip_cov_ratio`·N⌋, 1) (or all, if fewer) have their gradient detached. The choice is seeded by
  `clip_cov_seed`: the same seed and batch detach the same tokens.
- `kl_cov`: ℓ_t = −A_t·r_t, plus `kl_cov_coef`·|log r_t| on the max(⌊`kl_cov_ratio`·N⌋, 1) model tokens
  of largest cov_t.

Metrics: `clip_cov_frac` / `kl_cov_frac` (share of model tokens selected), `pg_clipfrac_high` /
`pg_clipfrac_low` (clip_cov), `ppo_kl` = mean(log π_old − log π).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.algo.policy_loss import POLICY_LOSSES, PolicyLossInputs, clamped_log_ratio, clipped_objective
from megarl.algo.stats import masked_mean

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig


def token_covariance(log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """cov_t `[b, t]` (no grad): centred log π times centred A, the means over the model tokens of `mask`."""
    log_prob, advantages = log_prob.detach(), advantages.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


def _num_selected(share: float, mask: Tensor) -> int:
    """max(⌊share·N⌋, 1) for N model tokens, 0 when there are none."""
    num_tokens = int(mask.sum())
    return min(max(int(share * num_tokens), 1), num_tokens)


def _flat_selection(flat_index: Tensor, like: Tensor) -> Tensor:
    """A bool mask shaped like `like`, True at the flattened positions `flat_index`."""
    chosen = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    chosen[flat_index] = True
    return chosen.view_as(like)


def _random_subset(candidates: Tensor, num: int, seed: int) -> Tensor:
    """A bool mask `[b, t]` of `num` of the True entries of `candidates` (all, if fewer), chosen by `seed`."""
    index = candidates.flatten().nonzero().squeeze(-1)
    order = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(seed))[:num]
    return _flat_selection(index[order.to(index.device)], candidates)


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO clip, with the gradient of a seeded random few high-covariance tokens detached.

    verl multiplies those tokens' loss by 0; detaching keeps their value in `pg_loss` with the same gradient."""
    params, mask = cfg.loss_params, inputs.response_mask.float()
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    ratio = log_ratio.exp()
    loss, metrics = clipped_objective(ratio, inputs.advantages, mask, cfg)
    ppo_clipped = loss > -inputs.advantages * ratio
    cov = token_covariance(inputs.log_prob, inputs.advantages, mask)
    candidates = (mask > 0) & ~ppo_clipped & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    selected = _random_subset(candidates, _num_selected(params.clip_cov_ratio, mask), params.clip_cov_seed)
    metrics["clip_cov_frac"] = masked_mean(selected.float(), mask)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    return torch.where(selected, loss.detach(), loss), metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: −A·r, plus a |log r| penalty on the top-k covariance tokens."""
    params, mask = cfg.loss_params, inputs.response_mask.float()
    log_ratio = clamped_log_ratio(inputs.log_prob, inputs.old_log_prob)
    cov = token_covariance(inputs.log_prob, inputs.advantages, mask).masked_fill(mask == 0, -torch.inf)
    top = cov.flatten().topk(_num_selected(params.kl_cov_ratio, mask)).indices
    selected = _flat_selection(top, cov)
    metrics = {
        "kl_cov_frac": masked_mean(selected.float(), mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return -inputs.advantages * log_ratio.exp() + params.kl_cov_coef * log_ratio.abs() * selected, metrics
