"""KL estimators and controllers, DAPO filters, masked statistics, and the registries' plug-in paths."""

import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import compose_config

from megarl.algo import (
    ADVANTAGE_ESTIMATORS,
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
from megarl.algo.policy_loss import PolicyLossInputs
from megarl.config import AlgorithmConfig, validate
from megarl.config.algorithm import KLControlConfig
from megarl.config.validate import critic_enabled

LOG_P, LOG_REF = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
DELTA = math.log(2.0)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["kl", "k1"], DELTA),
        (["abs"], DELTA),
        (["mse", "k2"], 0.5 * DELTA**2),
        (["low_var_kl", "k3"], 0.5 + DELTA - 1),  # e^{−Δ} + Δ − 1
    ],
)
def test_kl_estimators_by_hand(kinds: list[str], expected: float) -> None:
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, kind), torch.tensor([expected]))
        torch.testing.assert_close(kl_penalty(LOG_P, LOG_P, kind), torch.tensor([0.0]))


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
