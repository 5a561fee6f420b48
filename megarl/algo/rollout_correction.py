"""Rollout correction: importance weights and rejection between the rollout engine and the trainer.

The engine samples y ~ π_rollout with its own numerics (or an older checkpoint); the trainer's loss
assumes π_old. With the token log-ratio r_t = log π_old(y_t) − log π_rollout(y_t) (clamped to ±20)
and `algorithm.rollout_correction` (definitions after verl 0.9 `verl/trainer/ppo/rollout_corr_helper.py`,
`compute_rollout_correction_and_rejection_mask`, and its guide `docs/algo/rollout_corr.md`):

- `level`: token ρ_t = exp(r_t); sequence ρ_i = exp(Σ_t r_t); geometric ρ_i = exp(mean_t r_t)
  (a sequence's ρ_i applies to all its tokens); none = off.
- `mode`: truncate (TIS) w = clamp(ρ, lower, upper) and nothing is removed (lower null: no bound);
  mask (MIS) w = ρ on the tokens with lower ≤ ρ ≤ upper, the others leave the mask; reject: the same
  mask with w = 1 (pure rejection). In mask/reject mode lower null means 1/upper.
- `veto_threshold`: a model token with exp(r_t) below it removes its whole sequence (any level/mode).
- `batch_normalize`: the weights are divided by their mean m over the whole batch: over its kept tokens (token
  level) or kept sequences (sequence, geometric), so they average 1 there (verl's `rollout_is_batch_normalize`,
  which averages over all valid tokens, IcePop's zeroed ones included). The trainer computes m once on the
  driver (`batch_weight_mean`) and ships it with the rows; m <= 1e-8 leaves the weights alone.

`rollout_correction` returns detached weights (0 outside the returned mask), the corrected mask and
metrics under `rollout_corr/`. `algorithm.rollout_is_cap=C` is shorthand for level=token,
mode=truncate, upper=C.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.algo.stats import masked_mean, masked_sum, zero_outside

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig

LEVELS = ("none", "token", "sequence", "geometric")
MODES = ("truncate", "mask", "reject")
MAX_LOG_RATIO = 20.0
"""Log-ratios (token and sequence) are clamped to ±this before exp."""
PREFIX = "rollout_corr/"
MIN_BATCH_MEAN = 1e-8
"""`batch_normalize` leaves the weights alone when their batch mean is not above this (verl's guard)."""


def rollout_correction_problems(cfg: AlgorithmConfig) -> list[str]:
    """What is wrong with `algorithm.rollout_correction` / `rollout_is_cap`, one sentence each (empty: fine)."""
    rc, key = cfg.rollout_correction, "algorithm.rollout_correction"
    checks = [
        (rc.level in LEVELS, f"{key}.level={rc.level!r} is unknown; choose one of {', '.join(LEVELS)}"),
        (rc.mode in MODES, f"{key}.mode={rc.mode!r} is unknown; choose one of {', '.join(MODES)}"),
        (rc.upper > 0, f"{key}.upper={rc.upper} must be > 0"),
        (rc.lower is None or 0 <= rc.lower < rc.upper, f"{key}.lower={rc.lower} must be in [0, upper)"),
        (rc.veto_threshold is None or rc.veto_threshold > 0, f"{key}.veto_threshold={rc.veto_threshold} must be > 0"),
        (
            rc.veto_threshold is None or rc.level != "none",
            f"{key}.veto_threshold is set but {key}.level=none turns the correction off; choose a level",
        ),
        (
            not rc.batch_normalize or cfg.rollout_is_cap is not None or rc.level != "none",
            f"{key}.batch_normalize=true but {key}.level=none turns the correction off; choose a level",
        ),
        (cfg.rollout_is_cap is None or rc.level == "none", _both_set(rc.level)),
        (
            cfg.policy_loss != "bypass" or (rc.level == "none" and cfg.rollout_is_cap is None),
            "algorithm.policy_loss=bypass already weights by π/π_rollout (algorithm.loss_params.bypass_is_cap); "
            f"set algorithm.rollout_is_cap=null and {key}.level=none",
        ),
    ]
    return [message for ok, message in checks if not ok]


def _both_set(level: str) -> str:
    return (
        f"algorithm.rollout_is_cap and algorithm.rollout_correction.level={level} are both set; rollout_is_cap is "
        "shorthand for rollout_correction.level=token, mode=truncate, upper=<cap>: keep one of them"
    )


def resolve_rollout_correction(cfg: AlgorithmConfig) -> RolloutCorrectionConfig | None:
    """The correction in force: `rollout_correction`, or the `rollout_is_cap` shorthand; None when off."""
    rc = cfg.rollout_correction
    if cfg.rollout_is_cap is not None:
        if rc.level != "none":
            raise ValueError(_both_set(rc.level))
        return dataclasses.replace(rc, level="token", mode="truncate", upper=cfg.rollout_is_cap, lower=None)
    return None if rc.level == "none" else rc


def rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    cfg: RolloutCorrectionConfig,
    batch_mean: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(weights [b, t] detached, 0 outside the mask; mask [b, t] float without rejected tokens; metrics).

    Inputs are `[b, t]`; values outside `response_mask` are never read (NaN padding is safe). With
    `cfg.batch_normalize` the weights are divided by `batch_mean` (`[b]`, each row the whole batch's mean weight,
    `batch_weight_mean`; None: these rows are the whole batch). The weight metrics are before that division.
    """
    mask = response_mask.float()
    log_ratio = zero_outside(old_log_prob.detach() - rollout_log_prob.detach(), mask)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [b, t]
    ratio = level_ratio(log_ratio, mask, cfg.level)  # [b, t]
    not_vetoed = _veto_keep(log_ratio, mask, cfg.veto_threshold)  # [b, t]
    kept = mask * not_vetoed
    if cfg.mode == "truncate":
        weights = ratio.clamp(min=cfg.lower, max=cfg.upper)
        out_of_bounds = (weights != ratio).float()
    else:
        in_bounds = _in_bounds(ratio, cfg)
        kept = kept * in_bounds
        weights = ratio if cfg.mode == "mask" else torch.ones_like(ratio)
        out_of_bounds = 1.0 - in_bounds
    weights = zero_outside(weights, kept)
    metrics = _metrics(log_ratio, weights, mask, kept)
    metrics[PREFIX + "vetoed_seq_frac"] = _vetoed_seq_frac(mask, not_vetoed)
    frac_name = "truncated_frac" if cfg.mode == "truncate" else "masked_frac"
    metrics[PREFIX + frac_name] = masked_mean(out_of_bounds, mask)
    if cfg.batch_normalize:
        mean = _weight_mean(weights, kept, cfg.level) if batch_mean is None else batch_mean.reshape(-1, 1)
        weights = torch.where(mean > MIN_BATCH_MEAN, weights / mean, weights)
        metrics[PREFIX + "batch_norm_factor"] = mean.mean()
    return weights, kept, metrics


def batch_weight_mean(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, cfg: RolloutCorrectionConfig
) -> Tensor:
    """The weights' mean over the kept tokens (token level) or kept sequences (sequence, geometric) of these rows
    `[]`, before batch normalisation: what `batch_normalize` divides by."""
    unscaled = dataclasses.replace(cfg, batch_normalize=False)
    weights, kept, _ = rollout_correction(old_log_prob, rollout_log_prob, response_mask, unscaled)
    return _weight_mean(weights, kept, cfg.level)


def _weight_mean(weights: Tensor, kept: Tensor, level: str) -> Tensor:
    """Mean weight over the kept tokens, or (sequence levels, one weight per sequence) over the kept sequences."""
    if level == "token":
        return masked_mean(weights, kept)
    has_kept = (kept.sum(dim=-1) > 0).float()  # [b]
    return masked_mean(masked_mean(weights, kept, dim=-1), has_kept)


def level_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """ρ per token `[b, t]`: the token's own, or its sequence's product / geometric mean."""
    if level == "token":
        return log_ratio.exp()
    if level == "sequence":
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)
    elif level == "geometric":
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    else:
        raise ValueError(f"algorithm.rollout_correction.level={level!r} is unknown; choose one of {', '.join(LEVELS)}")
    return seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().unsqueeze(-1).expand_as(log_ratio)


def _in_bounds(ratio: Tensor, cfg: RolloutCorrectionConfig) -> Tensor:
    """1 where lower ≤ ρ ≤ upper (lower null: 1/upper), else 0 `[b, t]`."""
    lower = cfg.lower if cfg.lower is not None else 1.0 / cfg.upper
    return ((ratio >= lower) & (ratio <= cfg.upper)).float()


def _veto_keep(log_ratio: Tensor, mask: Tensor, threshold: float | None) -> Tensor:
    """0 on every token of a sequence that has a model token with π_old/π_rollout < threshold, else 1 `[b, t]`."""
    if threshold is None:
        return torch.ones_like(mask)
    catastrophic = (log_ratio.exp() < threshold) & mask.bool()
    return (~catastrophic.any(dim=-1, keepdim=True)).float().expand_as(mask)


def _vetoed_seq_frac(mask: Tensor, not_vetoed: Tensor) -> Tensor:
    """Share of the sequences with model tokens that the veto removed."""
    has_tokens = mask.sum(dim=-1) > 0  # [b]
    vetoed = has_tokens & (not_vetoed[:, 0] == 0)
    return vetoed.float().sum() / has_tokens.float().sum().clamp_min(1)


def _metrics(log_ratio: Tensor, weights: Tensor, mask: Tensor, kept: Tensor) -> dict[str, Tensor]:
    """Weight statistics over the kept tokens; divergences of the two policies over all model tokens."""
    weight_sum, weight_sq_sum = masked_sum(weights, kept), masked_sum(weights.square(), kept)
    ess = weight_sum.square() / (kept.sum() * weight_sq_sum).clamp_min(1e-12)
    return {
        PREFIX + "weight_mean": masked_mean(weights, kept),
        PREFIX + "weight_max": weights.max(),  # weights are >= 0 and 0 outside `kept`
        PREFIX + "ess": ess,
        PREFIX + "kl": masked_mean(-log_ratio, mask),
        PREFIX + "chi2": masked_mean((2 * log_ratio).exp() - 1.0, mask),
    }
