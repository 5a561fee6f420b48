"""CISPO, SAPO, GMPO and DPPO (TV / KL): token losses and gradients by hand on tiny tensors."""

import math
from typing import Any

import torch

from megarl.algo import PolicyLossInputs, policy_loss
from megarl.algo.policy_losses_ratio import _binary_kl
from megarl.config.algorithm import AlgorithmConfig, PolicyLossParams


def _inputs(
    probs: list[float], old_probs: list[float], advantages: list[float], mask: list[float] | None = None
) -> tuple[PolicyLossInputs, torch.Tensor]:
    """One row of tokens with π = probs and π_old = old_probs; returns the inputs and log π (requires grad)."""
    log_prob = torch.tensor([[math.log(p) for p in probs]], requires_grad=True)
    inputs = PolicyLossInputs(
        log_prob=log_prob,
        old_log_prob=torch.tensor([[math.log(p) for p in old_probs]]),
        advantages=torch.tensor([advantages]),
        response_mask=torch.tensor([mask if mask is not None else [1.0] * len(probs)]),
    )
    return inputs, log_prob


def _grad(loss: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, log_prob)
    return grad


def _cfg(name: str, **params: Any) -> AlgorithmConfig:
    return AlgorithmConfig(policy_loss=name, loss_params=PolicyLossParams(**params))


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient() -> None:
    # ratios 1.5, 0.5, 1.1, 0.9 → weights clip(r, 0.8, 1.2) = 1.2, 0.8, 1.1, 0.9
    probs, old = [0.6, 0.2, 0.55, 0.45], [0.4, 0.4, 0.5, 0.5]
    inputs, log_prob = _inputs(probs, old, [1.0, -1.0, 2.0, -1.0])
    cfg = _cfg("cispo", cispo_clip_ratio_low=0.2, cispo_clip_ratio_high=0.2)
    loss, metrics = policy_loss(inputs, cfg)
    weights, adv = [1.2, 0.8, 1.1, 0.9], [1.0, -1.0, 2.0, -1.0]
    expected = sum(-w * a * math.log(p) for w, a, p in zip(weights, adv, probs, strict=True)) / 4
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert float(metrics["pg_clipfrac_high"]) == 0.25 and float(metrics["pg_clipfrac_low"]) == 0.25
    # the weight is a constant: d/dlog π of −w·A·log π is −w·A on every token, clipped ones included
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-1.2 / 4, 0.8 / 4, -2.2 / 4, 0.9 / 4]]))


def test_cispo_has_no_lower_bound_by_default() -> None:
    inputs, log_prob = _inputs([0.05, 0.9], [0.5, 0.5], [1.0, 1.0])  # ratios 0.1 and 1.8
    loss, metrics = policy_loss(inputs, _cfg("cispo"))  # default: ratio ≤ 1.2, no floor
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-0.1 / 2, -1.2 / 2]]))
    assert float(metrics["pg_clipfrac_low"]) == 0 and float(metrics["pg_clipfrac_high"]) == 0.5


def test_sapo_soft_gate_by_hand() -> None:
    # ratios 1, 1.5 (A > 0, τ_pos = 1) and 0.5 (A < 0, τ_neg = 1.05)
    inputs, log_prob = _inputs([0.5, 0.6, 0.2], [0.5, 0.4, 0.4], [1.0, 2.0, -1.0])
    loss, metrics = policy_loss(inputs, _cfg("sapo"))
    sig = [0.5, 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(1.05 * 0.5))]  # σ(τ(r − 1))
    taus, ratios, adv = [1.0, 1.0, 1.05], [1.0, 1.5, 0.5], [1.0, 2.0, -1.0]
    token = [-(4 / t) * s * a for t, s, a in zip(taus, sig, adv, strict=True)]
    torch.testing.assert_close(loss, torch.tensor(sum(token) / 3))
    # d/dlog π of −(4/τ)σ(τ(r − 1))·A = −A·4σ(1 − σ)·r: exactly −A on-policy (r = 1), less away from it
    weights = [4 * s * (1 - s) for s in sig]
    grad = [-a * w * r / 3 for a, w, r in zip(adv, weights, ratios, strict=True)]
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([grad]))
    torch.testing.assert_close(metrics["sapo_gate_weight"], torch.tensor(sum(weights) / 3))


def test_sapo_negative_gate_decays_faster() -> None:
    """With τ_neg > τ_pos, the same ratio away from 1 gets a smaller gradient weight for A < 0."""
    pos, lp_pos = _inputs([0.9], [0.5], [1.0])
    neg, lp_neg = _inputs([0.9], [0.5], [-1.0])
    cfg = _cfg("sapo", sapo_tau_pos=1.0, sapo_tau_neg=3.0)
    assert abs(float(_grad(policy_loss(neg, cfg)[0], lp_neg))) < abs(float(_grad(policy_loss(pos, cfg)[0], lp_pos)))


def test_gmpo_geometric_mean_clipped_in_log_space() -> None:
    """Sequence 0 (A = 1): log-ratios 0.1, 0.6 → 0.1, 0.4 (clipped above); sequence 1 (A = −1): −0.6, 0.2
    and a padded token → −0.4 (clipped below), 0.2. Sequence losses −Â·exp(mean), averaged over sequences."""
    log_prob = torch.tensor([[0.1, 0.6, 0.0], [-0.6, 0.2, 9.0]], requires_grad=True)
    inputs = PolicyLossInputs(
        log_prob=log_prob,
        old_log_prob=torch.zeros(2, 3),
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]),
    )
    cfg = AlgorithmConfig(policy_loss="gmpo", loss_agg_mode="seq-mean-token-mean")
    loss, metrics = policy_loss(inputs, cfg)
    torch.testing.assert_close(loss, torch.tensor((-math.exp(0.25) + math.exp(-0.1)) / 2))
    assert float(metrics["pg_clipfrac_high"]) == 0.25 and float(metrics["pg_clipfrac_low"]) == 0.25
    # dL_i/dlog π_t = −Â_i·exp(mean c)/|y_i| on unclipped tokens, 0 on clipped ones; averaged over 2 sequences
    expected = torch.tensor([[-math.exp(0.25) / 4, 0, 0], [0, math.exp(-0.1) / 4, 0]])
    torch.testing.assert_close(_grad(loss, log_prob), expected)


def test_gmpo_pessimistic_clip_keeps_the_harmful_side() -> None:
    """A > 0 and a ratio below the range: the min keeps the unclipped log-ratio (and its gradient)."""
    inputs, log_prob = _inputs([math.exp(-1.0)], [1.0], [1.0])
    loss, metrics = policy_loss(inputs, AlgorithmConfig(policy_loss="gmpo"))
    torch.testing.assert_close(loss, torch.tensor(-math.exp(-1.0)))
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-math.exp(-1.0)]]))
    assert float(metrics["pg_clipfrac_high"]) == 0 and float(metrics["pg_clipfrac_low"]) == 0


def test_dppo_tv_masks_tokens_outside_the_trust_region() -> None:
    # π − π_old = 0.2 (A > 0: outside 0.15), 0.1 (inside), −0.05 (A < 0: inside), −0.2 (outside)
    probs, old, adv = [0.7, 0.6, 0.05, 0.7], [0.5, 0.5, 0.1, 0.9], [1.0, 1.0, -1.0, -1.0]
    inputs, log_prob = _inputs(probs, old, adv)
    loss, metrics = policy_loss(inputs, _cfg("dppo_tv", dppo_ratio_cap=1.1))
    # inside tokens: −A·min(r, 1.1)·log π with r = 1.2 → 1.1 and r = 0.5
    torch.testing.assert_close(loss, torch.tensor((-1.1 * math.log(0.6) + 0.5 * math.log(0.05)) / 4))
    assert float(metrics["pg_clipfrac_high"]) == 0.25 and float(metrics["pg_clipfrac_low"]) == 0.25
    assert float(metrics["dppo_ratio_capped_frac"]) == 0.25
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[0, -1.1 / 4, 0.5 / 4, 0]]))


def test_binary_kl_by_hand() -> None:
    old, new = torch.log(torch.tensor([0.5, 0.5, 0.9])), torch.log(torch.tensor([0.7, 0.45, 0.9]))
    expected = [
        0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3),
        0.5 * math.log(0.5 / 0.45) + 0.5 * math.log(0.5 / 0.55),
        0.0,
    ]
    torch.testing.assert_close(_binary_kl(old, new), torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_dppo_kl_masks_by_binary_kl_in_the_advantage_direction() -> None:
    # binary KL from 0.5: to 0.7 or 0.3 is 0.087 > 0.05, to 0.45 is 0.005.
    # A > 0 up to 0.7: outside; A > 0 down to 0.3: inside (moved against A); A < 0 down to 0.3: outside;
    # A < 0 down to 0.45: inside (small KL)
    probs, adv = [0.7, 0.3, 0.3, 0.45], [1.0, 1.0, -1.0, -1.0]
    inputs, log_prob = _inputs(probs, [0.5] * 4, adv)
    loss, metrics = policy_loss(inputs, _cfg("dppo_kl"))
    torch.testing.assert_close(loss, torch.tensor((-0.6 * math.log(0.3) + 0.9 * math.log(0.45)) / 4))
    assert float(metrics["pg_clipfrac_high"]) == 0.25 and float(metrics["pg_clipfrac_low"]) == 0.25
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[0, -0.6 / 4, 0, 0.9 / 4]]))
