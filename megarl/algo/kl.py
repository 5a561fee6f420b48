"""KL between the policy and the reference, as a reward penalty or a loss term.

Per-token estimators of KL(π || π_ref) from log-probs (Schulman's k1/k2/k3), by
`algorithm.kl_penalty` (in the reward) and `algorithm.kl_loss_type` (as a loss), with
Δ = log π − log π_ref:

- `kl` / `k1`:          Δ                      (unbiased, can be negative)
- `abs`:                |Δ|
- `mse` / `k2`:         Δ² / 2
- `low_var_kl` / `k3`:  e^{−Δ} + Δ − 1         (≥ 0, low variance; Δ clamped to ±20, result to [0, 10])
- `kl+` / `k1+`, `abs+`, `low_var_kl+` / `k3+`: straight-through — the value of the estimator
  without `+`, the gradient of k2 (Δ·∇log π, the unbiased gradient of KL(π || π_ref)); names and
  trick from verl 0.9 `verl/trainer/ppo/core_algos.py:kl_penalty` (fixed in verl PR #6058);
  Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.

Where the logits of both models are at hand, `full_kl_from_logits` computes the exact
KL(π || π_ref) = Σ_v π_v (log π_v − log π_ref,v) per position instead of an estimate.

KL in the reward (`use_kl_in_reward`): r_t ← r_t − β·kl_t on model tokens, with β from a
controller (`kl_ctrl.type`): `fixed` keeps β = kl_coef; `adaptive` (Ziegler et al.) moves β toward
`target_kl` after every step: e = clip(KL / target − 1, ±0.2), β ← β·(1 + e·n / horizon), n = the
number of trajectories in the step. KL as a loss (`use_kl_loss`): loss += kl_loss_coef · agg(kl_t).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from megarl.algo.registry import Registry
from megarl.algo.stats import masked_mean, zero_outside

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import KLControlConfig

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("algorithm.kl_penalty / algorithm.kl_loss_type")


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    log_ratio = (ref_log_prob - log_prob).clamp(-20, 20)
    return (log_ratio.exp() - log_ratio - 1).clamp(0, 10)


def _k2_gradient(value: Tensor, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """`value` in the forward pass, the gradient of k2 in the backward pass."""
    k2 = kl_k2(log_prob, ref_log_prob)
    return value.detach() + (k2 - k2.detach())


@KL_ESTIMATORS.register("kl+", "k1+")
def kl_k1_plus(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return _k2_gradient(kl_k1(log_prob, ref_log_prob), log_prob, ref_log_prob)


@KL_ESTIMATORS.register("abs+")
def kl_abs_plus(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return _k2_gradient(kl_abs(log_prob, ref_log_prob), log_prob, ref_log_prob)


@KL_ESTIMATORS.register("low_var_kl+", "k3+")
def kl_k3_plus(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return _k2_gradient(kl_k3(log_prob, ref_log_prob), log_prob, ref_log_prob)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str, response_mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimate `[b, t]` by estimator name (see the module docstring).

    With `response_mask`, log-probs off the mask are never read and the estimate is 0 there; pass it
    whenever the padding may hold NaN/inf, or the k2 gradient (Δ·0 = NaN) reaches the model from there.
    """
    estimator = KL_ESTIMATORS.get(kind)
    if response_mask is None:
        return estimator(log_prob.float(), ref_log_prob.float())
    kl = estimator(zero_outside(log_prob.float(), response_mask), zero_outside(ref_log_prob.float(), response_mask))
    return zero_outside(kl, response_mask)


def full_kl_from_logits(logits: Tensor, ref_logits: Tensor, response_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Exact KL(π || π_ref) `[b, t]` from full-vocabulary logits `[b, t, v]` (float32); 0 off the mask.

    Both models' logits are divided by the sampling `temperature`. Positions off the mask are replaced
    by zeros before the softmax, so NaN/inf there reach neither the result nor the gradient. With
    tensor parallelism the logits must cover the whole vocabulary (gather the `v/tp` shards first).
    """
    keep = response_mask.bool().unsqueeze(-1)  # [b, t, 1]
    log_p = torch.log_softmax(zero_outside(logits.float(), keep) / temperature, dim=-1)  # [b, t, v]
    log_ref = torch.log_softmax(zero_outside(ref_logits.float(), keep) / temperature, dim=-1)
    probs = log_p.exp()
    log_ratio = torch.where(probs > 0, log_p - log_ref, 0.0)  # 0·log(0/q) = 0, also where both are −inf
    return zero_outside((probs * log_ratio).sum(dim=-1), response_mask)


def apply_kl_in_reward(
    token_rewards: Tensor, log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor, kind: str, coef: float
) -> tuple[Tensor, float]:
    """(rewards − coef·kl on model tokens, the batch KL: mean over sequences of each one's token-mean KL).

    Log-probs off the mask are never read, so NaN/inf padding there leaves the rewards as they were.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind, response_mask)
    current_kl = float(masked_mean(kl, response_mask, dim=-1).mean())
    return token_rewards - coef * kl, current_kl


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, num_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """β stays at its initial value; the state of every controller is β."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·num_steps/horizon)."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(kl_coef)
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, num_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")


def make_kl_controller(cfg: KLControlConfig) -> KLController:
    """The controller `cfg.type` names, starting at `cfg.kl_coef`."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={cfg.type!r} is unknown; choose one of {', '.join(KL_CONTROLLERS)}")
