"""Optimal token baseline (OTB): a per-step, per-group baseline weighted by realized energy.

Sources: "Optimal Token Baseline", arXiv:2602.07078 (richardli.xyz/optimal-token-baseline); verl 0.9
`verl/trainer/ppo/core_algos.py` `compute_optimal_token_baseline_advantage` (single-turn) and
`compute_multi_turn_optimal_token_baseline_advantage` (multi-turn), and verl's docs/algo/otb.md.

For the trajectories i of one group (same prompt) at step t:

    G_it = Σ_{t' ≥ t} r_it'                       reward-to-go
    w_it = (1 − 2·π_it + Σ_v π_it(v)²)·ρ_it²      logit-gradient proxy; π = π_old of the sampled token,
                                                  ρ = truncated IS ratio (1 without rollout IS)
    W_it = Σ_{t' ≤ t} w_it'                       realized energy, over model tokens
    B_t  = Σ_i G_it·W_it / (Σ_i W_it + 1e-8)      over the trajectories alive at step t
    A_it = G_it − B_t

Where fewer than two of the group's trajectories are alive, B_t = 0 and A = G: verl's rule for a
group of one and its zero-tail rule (past the second-longest trajectory of a group, the longest
would otherwise be its own baseline) in one. With `handle_zero_tail=False`
(`algorithm.otb_handle_zero_tail`) only a group of one trajectory with model tokens gets B = 0, and the
longest trajectory's tail is its own baseline (B_t = G_it·W_it / (W_it + 1e-8), A ≈ 0), as verl's flag off.
A step is a response position in the single-turn variant and the index among the trajectory's own model
tokens in the multi-turn variant, where tool and user tokens sit between the turns.
"""

import torch
from torch import Tensor

from megarl.algo.stats import dense_group_index, zero_outside

OTB_EPS = 1e-8
"""Added to Σ_i W_it before dividing (verl's epsilon)."""


def sum_pi_squared_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Σ_v π(v)² `[...]` from logits `[..., v]`: exp(logsumexp(2z) − 2·logsumexp(z)), z = logits / temperature."""
    scaled = logits.float() / temperature
    return (torch.logsumexp(2 * scaled, dim=-1) - 2 * torch.logsumexp(scaled, dim=-1)).exp()


def realized_energy(
    old_log_probs: Tensor, sum_pi_squared: Tensor, response_mask: Tensor, is_weights: Tensor | None
) -> Tensor:
    """W `[b, t]`: running sum over model tokens of w = (1 − 2π + Σπ²)·ρ² (`is_weights` = ρ, None = 1)."""
    w = 1 - 2 * old_log_probs.float().exp() + sum_pi_squared.float()
    if is_weights is not None:
        w = w * is_weights.float().square()
    return zero_outside(w, response_mask).cumsum(dim=-1)


def otb_advantages(
    returns: Tensor,
    energy: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    per_model_token: bool,
    handle_zero_tail: bool = True,
) -> Tensor:
    """Advantages G − B `[b, t]`, 0 off the mask; `per_model_token` aligns steps by model-token index (multi-turn);
    `handle_zero_tail`: B = 0 wherever fewer than two of the group are alive (else only in groups of one)."""
    if not per_model_token:
        alive = response_mask.bool()
        baseline = _group_baseline(returns, energy, alive, group_ids, handle_zero_tail)
        return zero_outside(returns - baseline, alive)
    lengths = response_mask.bool().sum(dim=-1, keepdim=True)  # [b, 1]
    alive = torch.arange(response_mask.shape[1], device=response_mask.device) < lengths
    step_returns = _to_steps(returns, response_mask)
    baseline = _group_baseline(step_returns, _to_steps(energy, response_mask), alive, group_ids, handle_zero_tail)
    return _from_steps(step_returns - baseline, response_mask)


def _group_baseline(returns: Tensor, energy: Tensor, alive: Tensor, group_ids: Tensor, zero_tail: bool) -> Tensor:
    """B `[b, t]`: Σ G·W / (Σ W + ε) over each group's alive trajectories; 0 where fewer than two are alive
    (`zero_tail`) or in groups of fewer than two trajectories with model tokens."""
    index, num_groups = dense_group_index(group_ids)

    def group_sum(x: Tensor) -> Tensor:  # [b, t] → the row's group total at each step, [b, t]
        totals = torch.zeros(num_groups, x.shape[1], device=x.device)
        return totals.index_add_(0, index, zero_outside(x.float(), alive))[index]

    baseline = group_sum(returns * energy) / (group_sum(energy) + OTB_EPS)
    if zero_tail:
        return torch.where(group_sum(alive.float()) >= 2, baseline, 0.0)
    members = torch.zeros(num_groups, device=alive.device).index_add_(0, index, alive.any(dim=-1).float())[index]
    return torch.where(members.unsqueeze(-1) >= 2, baseline, 0.0)


def _to_steps(x: Tensor, response_mask: Tensor) -> Tensor:
    """Each row's values at its model tokens, in order, moved to the front `[b, t]` (0 after them)."""
    keep = response_mask.bool()
    step = keep.long().cumsum(dim=-1) - 1
    target = torch.where(keep, step, x.shape[1])  # off the mask: a spare last column, dropped below
    spread = torch.zeros(x.shape[0], x.shape[1] + 1, device=x.device)
    return spread.scatter_(1, target, zero_outside(x.float(), keep))[:, :-1]


def _from_steps(steps: Tensor, response_mask: Tensor) -> Tensor:
    """Inverse of `_to_steps`: step values back at their model tokens `[b, t]`, 0 elsewhere."""
    keep = response_mask.bool()
    step = (keep.long().cumsum(dim=-1) - 1).clamp_min(0)
    return zero_outside(steps.gather(1, step), keep)
