"""KL estimators and controllers, DAPO filters, masked statistics, and the registries' plug-in paths."""

import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import compose_config

from megarl.algo import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    apply_kl_in_reward,
    compute_advantages,
    estimator_traits,
    filter_uniform_groups,
    group_mean_std,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    overlong_penalty,
    policy_loss,
)
from megarl.algo.kl import full_kl_from_logits
from megarl.algo.policy_loss import PolicyLossInputs
from megarl.config import AlgorithmConfig
from megarl.config.algorithm import KLControlConfig
from megarl.plan.facts import critic_enabled
from megarl.plan.gate import validate

LOG_P, LOG_REF = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
DELTA = math.log(2.0)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["kl", "k1", "kl+", "k1+"], DELTA),
        (["abs", "abs+"], DELTA),
        (["mse", "k2"], 0.5 * DELTA**2),
        (["low_var_kl", "k3", "low_var_kl+", "k3+"], 0.5 + DELTA - 1),  # e^{−Δ} + Δ − 1
    ],
)
def test_kl_estimators_by_hand(kinds: list[str], expected: float) -> None:
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, kind), torch.tensor([expected]))
        torch.testing.assert_close(kl_penalty(LOG_P, LOG_P, kind), torch.tensor([0.0]))


def _grad(kind: str, log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    leaf = log_p.clone().requires_grad_()
    kl_penalty(leaf, log_ref, kind).sum().backward()
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_straight_through_estimators_have_the_gradient_of_k2(sign: float) -> None:
    log_p, log_ref = (LOG_P, LOG_REF) if sign > 0 else (LOG_REF, LOG_P)  # Δ = ±log 2
    delta = sign * DELTA
    # d/dlog π: k1 → 1, |Δ| → sign(Δ), k3 = e^{−Δ} + Δ − 1 → 1 − e^{−Δ}, k2 = Δ²/2 → Δ
    own = {"k1": 1.0, "abs": sign, "k3": 1 - math.exp(-delta), "k2": delta}
    for kind, grad in own.items():
        torch.testing.assert_close(_grad(kind, log_p, log_ref), torch.tensor([grad]))
    for kind in ("k1+", "kl+", "abs+", "k3+", "low_var_kl+"):
        torch.testing.assert_close(_grad(kind, log_p, log_ref), torch.tensor([delta]))
        torch.testing.assert_close(kl_penalty(log_p, log_ref, kind), kl_penalty(log_p, log_ref, kind[:-1]))


@pytest.mark.parametrize("kind", KL_ESTIMATORS.names())
def test_kl_with_a_mask_never_reads_the_padding(kind: str) -> None:
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    log_p = torch.tensor([[math.log(0.5), math.nan, 0.0]], requires_grad=True)
    log_ref = torch.tensor([[math.log(0.25), 0.0, -math.inf]])
    kl = kl_penalty(log_p, log_ref, kind, mask)
    torch.testing.assert_close(kl, torch.cat([kl_penalty(LOG_P, LOG_REF, kind), torch.zeros(2)])[None])
    kl.sum().backward()
    assert log_p.grad is not None
    torch.testing.assert_close(log_p.grad, torch.cat([_grad(kind, LOG_P, LOG_REF), torch.zeros(2)])[None])


def test_full_kl_from_logits_by_hand() -> None:
    # π = softmax([0, log 3]) = [1/4, 3/4], π_ref = [1/2, 1/2]; position 1 is padding full of NaN.
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.nan, math.nan]]], requires_grad=True)
    ref_logits = torch.tensor([[[0.0, 0.0], [math.inf, -math.inf]]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    kl = full_kl_from_logits(logits, ref_logits, mask)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    torch.testing.assert_close(kl, torch.tensor([[expected, 0.0]]))
    kl.sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    # dKL/dz_j = π_j (log π_j/π_ref_j − KL); dKL/dz_ref_j = π_ref_j − π_j; padding gets 0
    grad = [0.25 * (math.log(0.5) - expected), 0.75 * (math.log(1.5) - expected)]
    torch.testing.assert_close(logits.grad, torch.tensor([[grad, [0.0, 0.0]]]))
    torch.testing.assert_close(ref_logits.grad, torch.tensor([[[0.25, -0.25], [0.0, 0.0]]]))
    hot = full_kl_from_logits(2 * logits.detach(), 2 * ref_logits.detach(), mask, temperature=2.0)
    torch.testing.assert_close(hot, kl.detach())


def test_full_kl_matches_the_expectation_of_k1() -> None:
    logits, ref_logits = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    log_p, log_ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    expected = (log_p.exp() * kl_penalty(log_p, log_ref, "k1")).sum(-1)
    torch.testing.assert_close(full_kl_from_logits(logits, ref_logits, torch.ones(2, 3)), expected)


def test_low_var_kl_is_nonnegative_and_clamped() -> None:
    log_p = torch.linspace(-60, 60, 101)
    kl = kl_penalty(log_p, torch.zeros_like(log_p), "low_var_kl")
    assert (kl >= 0).all() and (kl <= 10).all() and torch.isfinite(kl).all()
    assert float(kl_penalty(torch.tensor([60.0]), torch.tensor([0.0]), "kl")) == 60.0


def test_kl_in_reward_by_hand() -> None:
    rewards, current = apply_kl_in_reward(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.1, 0.3]]), torch.zeros(1, 2), torch.ones(1, 2), "kl", coef=0.5
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.85]]))
    assert current == pytest.approx(0.2)
    rewards, _ = apply_kl_in_reward(
        torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([[1, 0]]), "kl", coef=1.0
    )
    assert rewards.tolist() == [[-1.0, 0.0]]  # no penalty on a masked token
    rewards, current = apply_kl_in_reward(
        torch.zeros(1, 3),
        torch.tensor([[1.0, math.nan, math.inf]]),
        torch.tensor([[0.0, 0.0, -math.inf]]),
        torch.tensor([[1, 0, 0]]),
        "k3+",
        coef=1.0,
    )
    # k3 with Δ = 1 on the model token: e^{−1} + 1 − 1; NaN/inf log-probs on the padding are never read
    torch.testing.assert_close(rewards, torch.tensor([[-math.exp(-1), 0.0, 0.0]]))
    assert current == pytest.approx(math.exp(-1))


def test_kl_controllers() -> None:
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.1))
    fixed.update(current_kl=5.0, num_steps=100)
    assert fixed.value == 0.1
    adaptive = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=100))
    adaptive.update(current_kl=0.2, num_steps=10)  # error clipped to +0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02)
    adaptive.update(current_kl=0.05, num_steps=10)  # error −0.5 clipped to −0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 0.98)
    restored = AdaptiveKLController(kl_coef=1.0, target_kl=0.1, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


def test_dynamic_sampling_drops_uniform_groups() -> None:
    result = filter_uniform_groups(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]))
    assert result.keep.tolist() == [False, False, True, True, True]  # a group of one is kept
    assert (result.num_groups, result.num_kept_groups) == (3, 2)


def test_overlong_penalty_by_hand() -> None:
    penalty = overlong_penalty(
        torch.tensor([50, 80, 90, 100]), max_response_length=100, buffer_length=20, penalty_factor=1.0
    )
    assert penalty.tolist() == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([1]), max_response_length=10, buffer_length=0, penalty_factor=1.0)


def test_masked_statistics_ignore_padding_and_never_nan() -> None:
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(masked_mean(x, mask)) == 2.0
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0, 0.0]  # an all-masked row means 0
    assert float(masked_var(x, mask)) == 2.0  # unbiased over [1, 3]
    assert float(masked_var(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))) == 0.0  # one element
    white = masked_whiten(x, mask)
    torch.testing.assert_close(white, torch.tensor([[-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]) / math.sqrt(2.0 + 1e-6))
    assert masked_whiten(x, torch.zeros_like(mask)).eq(0).all()
    mean, std, count = group_mean_std(torch.tensor([1.0, 3.0, 7.0]), torch.tensor([5, 5, 9]))
    assert mean.tolist() == [2.0, 2.0, 7.0] and count.tolist() == [2, 2, 1]
    assert std[2] == 0 and std[0] == pytest.approx(math.sqrt(2.0))


PLUGIN = """
import torch
from megarl.algo import register_advantage_estimator


@register_advantage_estimator("plugin_score_minus_one", uses_critic=True)
def score_minus_one(inputs, cfg):
    adv = (inputs.token_rewards.sum(-1, keepdim=True) - 1) * inputs.response_mask
    return adv, adv


def unregistered(inputs, cfg):
    return inputs.token_rewards, inputs.token_rewards


def double_ppo(inputs, cfg):
    from megarl.algo.policy_loss import ppo_loss
    loss, metrics = ppo_loss(inputs, cfg)
    return 2 * loss, metrics
"""


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_algo_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_algo_plugin"


def test_user_functions_by_dotted_path(plugin_module: str) -> None:
    inputs = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 3.0]]),
        response_mask=torch.tensor([[1.0, 0.0]]),
        group_ids=torch.tensor([0]),
        values=torch.zeros(1, 2),
    )
    adv, _ = compute_advantages(inputs, AlgorithmConfig(adv_estimator=f"{plugin_module}:score_minus_one"))
    assert adv.tolist() == [[2.0, 0.0]]
    assert estimator_traits(f"{plugin_module}:score_minus_one").uses_critic  # its decorator's traits
    assert "plugin_score_minus_one" in ADVANTAGE_ESTIMATORS.names()
    assert not estimator_traits(f"{plugin_module}.unregistered").uses_critic
    log_prob = torch.zeros(1, 2)
    ppo_inputs = PolicyLossInputs(
        log_prob=log_prob, old_log_prob=log_prob, advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2)
    )
    loss, _ = policy_loss(ppo_inputs, AlgorithmConfig(policy_loss=f"{plugin_module}:double_ppo"))
    assert float(loss) == -2.0


def test_config_with_a_plugin_estimator_enables_the_critic(plugin_module: str, data_overrides: list[str]) -> None:
    cfg = compose_config(f"algorithm.adv_estimator={plugin_module}:score_minus_one", *data_overrides)
    validate(cfg)
    assert critic_enabled(cfg)


def test_registering_a_taken_name_fails() -> None:
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda inputs, cfg: (inputs, inputs))
    with pytest.raises(ValueError, match="choose one of"):
        ADVANTAGE_ESTIMATORS.get("nope")
