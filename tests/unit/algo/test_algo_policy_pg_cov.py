"""GPG, DRO, bypass, Clip-Cov and KL-Cov by hand; on-policy reduction of every ratio loss; the presets."""

import math
from typing import Any

import pytest
import torch
from conftest import compose_config

from megarl.algo import POLICY_LOSSES, PolicyLossInputs, policy_loss
from megarl.config.algorithm import AlgorithmConfig, PolicyLossParams


def _row(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor([values], requires_grad=grad)


def _grad(loss: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, log_prob)
    return grad


def _cfg(name: str, **params: Any) -> AlgorithmConfig:
    return AlgorithmConfig(policy_loss=name, loss_params=PolicyLossParams(**params))


def test_gpg_is_minus_advantage_times_log_prob() -> None:
    log_prob = _row([-0.5, -2.0, -1.0], grad=True)
    inputs = PolicyLossInputs(log_prob, _row([-1.0, -1.0, -1.0]), _row([2.0, -1.0, 0.5]), _row([1.0, 1.0, 0.0]))
    token_loss, metrics = POLICY_LOSSES.get("gpg")(inputs, _cfg("gpg"))
    torch.testing.assert_close(token_loss, -inputs.advantages * log_prob)
    loss, _ = policy_loss(inputs, _cfg("gpg"))
    torch.testing.assert_close(loss, torch.tensor((2.0 * 0.5 - 1.0 * 2.0) / 2))
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-2.0 / 2, 1.0 / 2, 0.0]]))
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor((-0.5 + 1.0) / 2))  # mean(log π_old − log π)


def test_dro_quadratic_log_ratio_penalty() -> None:
    log_prob = _row([-0.5, -2.0], grad=True)
    inputs = PolicyLossInputs(log_prob, _row([-1.0, -1.0]), _row([2.0, -1.0]), _row([1.0, 1.0]))
    loss, _ = policy_loss(inputs, _cfg("dro", dro_beta=0.1))
    # −A·log π + ½β(log π − log π_old)²: 1 + 0.0125 and −2 + 0.05
    torch.testing.assert_close(loss, torch.tensor((1.0125 - 1.95) / 2))
    # −A + β·(log π − log π_old)
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[(-2.0 + 0.05) / 2, (1.0 - 0.1) / 2]]))
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss(inputs, _cfg("dro"))


def _bypass_inputs(rollout: list[float] | None) -> tuple[PolicyLossInputs, torch.Tensor]:
    log_prob = torch.log(torch.tensor([[0.6, 0.6, 0.25]])).requires_grad_()
    nothing = torch.full((1, 3), math.nan)  # the old log-probs are never read
    rollout_log_prob = None if rollout is None else torch.log(torch.tensor([rollout]))
    return PolicyLossInputs(
        log_prob, nothing, _row([1.0, -1.0, 2.0]), _row([1.0, 1.0, 1.0]), rollout_log_prob
    ), log_prob


def test_bypass_reinforce_weighted_by_the_rollout_ratio() -> None:
    inputs, log_prob = _bypass_inputs([0.5, 0.2, 0.5])  # π/π_rollout = 1.2, 3 → capped at 2, 0.5
    loss, metrics = policy_loss(inputs, _cfg("bypass"))
    weights, adv, probs = [1.2, 2.0, 0.5], [1.0, -1.0, 2.0], [0.6, 0.6, 0.25]
    expected = sum(-w * a * math.log(p) for w, a, p in zip(weights, adv, probs, strict=True)) / 3
    torch.testing.assert_close(loss, torch.tensor(expected))
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[-1.2 / 3, 2.0 / 3, -1.0 / 3]]))
    torch.testing.assert_close(metrics["rollout_is_weight_mean"], torch.tensor(3.7 / 3))
    torch.testing.assert_close(metrics["rollout_is_capped_frac"], torch.tensor(1 / 3))
    plain, _ = policy_loss(inputs, _cfg("bypass", bypass_is_cap=None))  # no IS weight: REINFORCE
    torch.testing.assert_close(_grad(plain, log_prob), torch.tensor([[-1.0 / 3, 1.0 / 3, -2.0 / 3]]))


def test_bypass_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(_bypass_inputs(None)[0], _cfg("bypass"))
    cfg = AlgorithmConfig(policy_loss="bypass", rollout_is_cap=2.0)
    with pytest.raises(ValueError, match="rollout_is_cap=null"):
        policy_loss(_bypass_inputs([0.5, 0.5, 0.5])[0], cfg)


def _cov_inputs() -> tuple[PolicyLossInputs, torch.Tensor]:
    """Four model tokens and a padded one. Centred A = [1, 1, −1, −1], centred log π = [1, −1, 0.5, −0.5]:
    covariances [1, −1, −0.5, 0.5]; the padded token would have the largest one if it counted."""
    log_prob = _row([-0.5, -2.5, -1.0, -2.0, 10.0], grad=True)
    old = log_prob.detach() - torch.tensor([[0.1, 0.15, -0.1, 0.3, 0.0]])  # log r: all inside PPO's clip range
    advantages = _row([1.0, 1.0, -1.0, -1.0, 10.0])
    return PolicyLossInputs(log_prob, old, advantages, _row([1.0, 1.0, 1.0, 1.0, 0.0])), log_prob


def test_kl_cov_penalises_the_top_covariance_tokens() -> None:
    inputs, log_prob = _cov_inputs()
    cfg = _cfg("kl_cov", kl_cov_ratio=0.25, kl_cov_coef=0.5)  # k = 1: token 0 (cov 1)
    loss, metrics = policy_loss(inputs, cfg)
    ratios = [math.exp(0.1), math.exp(0.15), math.exp(-0.1), math.exp(0.3)]
    adv = [1.0, 1.0, -1.0, -1.0]
    torch.testing.assert_close(loss, torch.tensor((sum(-a * r for a, r in zip(adv, ratios, strict=True)) + 0.05) / 4))
    grad = [(-a * r) / 4 for a, r in zip(adv, ratios, strict=True)]
    grad[0] += 0.5 / 4  # d|log r|/dlog π = sign(log r) = 1
    torch.testing.assert_close(_grad(loss, log_prob), torch.tensor([[*grad, 0.0]]))
    assert float(metrics["kl_cov_frac"]) == 0.25
    two, _ = policy_loss(inputs, _cfg("kl_cov", kl_cov_ratio=0.5, kl_cov_coef=0.5))  # k = 2: tokens 0 and 3
    torch.testing.assert_close(two - loss, torch.tensor(0.5 * 0.3 / 4))


def test_clip_cov_detaches_a_seeded_candidate_within_bounds() -> None:
    """lb = 0.2: candidates are tokens 0 and 3 (cov 1 and 0.5); one (ratio 0.25 of 4) is detached."""
    inputs, log_prob = _cov_inputs()
    ppo, _ = policy_loss(inputs, AlgorithmConfig(clip_ratio_c=100.0))
    chosen = set()
    for seed in range(8):
        cfg = _cfg("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=0.2, clip_cov_ub=5.0, clip_cov_seed=seed)
        loss, metrics = policy_loss(inputs, cfg)
        torch.testing.assert_close(loss, ppo)  # same value: only the gradient is removed
        assert float(metrics["clip_cov_frac"]) == 0.25
        zero = (_grad(loss, log_prob)[0, :4] == 0).nonzero().flatten().tolist()
        assert len(zero) == 1 and zero[0] in (0, 3)
        chosen.add(zero[0])
    assert chosen == {0, 3}  # the seed picks among the candidates
    cfg = _cfg("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=0.6, clip_cov_ub=5.0)  # only token 0 qualifies
    grad = _grad(policy_loss(inputs, cfg)[0], log_prob)
    ratios = [math.exp(0.1), math.exp(0.15), math.exp(-0.1), math.exp(0.3)]
    torch.testing.assert_close(grad, torch.tensor([[0.0, -ratios[1] / 4, ratios[2] / 4, ratios[3] / 4, 0.0]]))


def test_clip_cov_skips_tokens_ppo_already_clipped() -> None:
    """clip_ratio_high = 0.05: PPO clips token 0 (A > 0, r = e^0.1 > 1.05), which leaves token 3 (A < 0,
    unclipped) the only candidate of lb = 0.2, whatever the seed."""
    inputs, log_prob = _cov_inputs()
    cfg = AlgorithmConfig(
        policy_loss="clip_cov",
        clip_ratio_high=0.05,
        loss_params=PolicyLossParams(clip_cov_ratio=0.25, clip_cov_lb=0.2, clip_cov_ub=5.0),
    )
    for seed in range(4):
        cfg.loss_params.clip_cov_seed = seed
        grad = _grad(policy_loss(inputs, cfg)[0], log_prob)
        assert grad[0, 3] == 0 and grad[0, 2] != 0


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_selection_is_seeded_and_stays_on_model_tokens(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 10, generator=g) > 0.3).float()
    log_prob = (-torch.rand(6, 10, generator=g) * 3).requires_grad_()
    advantages = torch.randn(6, 10, generator=g)
    inputs = PolicyLossInputs(log_prob, log_prob.detach() + 0.01, advantages, mask)

    def selected(seed: int) -> torch.Tensor:
        params = {"clip_cov_ratio": 0.3, "clip_cov_lb": -1e9, "clip_cov_seed": seed, "kl_cov_ratio": 0.3}
        token_loss, _ = POLICY_LOSSES.get(name)(inputs, _cfg(name, **params))
        plain = -advantages * (log_prob.detach() - inputs.old_log_prob).exp()  # d(−A·r)/dlog π; r = 0.99: unclipped
        return ~torch.isclose(_grad(token_loss.sum(), log_prob), plain)  # the selected tokens' gradient differs

    first = selected(0)
    assert first.sum() == int(0.3 * mask.sum()) and not (first & (mask == 0)).any()
    assert torch.equal(selected(0), first)
    if name == "clip_cov":
        assert not torch.equal(selected(1), first)


ON_POLICY = ["ppo", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "kl_cov", "dro", "bypass"]


@pytest.mark.parametrize("name", ON_POLICY)
def test_on_policy_the_gradient_is_the_plain_policy_gradient(name: str) -> None:
    """With π = π_old = π_rollout (ratio ≡ 1), every loss's gradient equals that of GPG's −A·log π."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    log_prob = (-torch.rand(4, 6, generator=g) * 3).requires_grad_()
    advantages = torch.randn(4, 1, generator=g).expand(4, 6) * mask  # one advantage per sequence (GMPO's case)
    inputs = PolicyLossInputs(log_prob, log_prob.detach(), advantages, mask, rollout_log_prob=log_prob.detach())
    agg = "seq-mean-token-mean"
    cfg = AlgorithmConfig(policy_loss=name, loss_agg_mode=agg, loss_params=PolicyLossParams(dro_beta=0.1))
    expected = _grad(policy_loss(inputs, AlgorithmConfig(policy_loss="gpg", loss_agg_mode=agg))[0], log_prob)
    torch.testing.assert_close(_grad(policy_loss(inputs, cfg)[0], log_prob), expected)


@pytest.mark.parametrize(
    ("preset", "name", "agg"),
    [
        ("cispo", "cispo", "token-mean"),
        ("sapo", "sapo", "seq-mean-token-mean"),
        ("gmpo", "gmpo", "seq-mean-token-mean"),
    ],
)
def test_presets_compose(preset: str, name: str, agg: str) -> None:
    cfg = compose_config(f"algorithm={preset}", "algorithm.loss_params.dro_beta=0.05")
    assert (cfg.algorithm.policy_loss, cfg.algorithm.loss_agg_mode) == (name, agg)
    assert cfg.algorithm.loss_params.dro_beta == 0.05
