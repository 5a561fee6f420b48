"""The variants verl exposes, by hand on tiny tensors: DPPO's and GMPO's asymmetric bounds, the optimal token
baseline without its zero tail, bypass with sequence-level weights and the IcePop band, batch-normalised
rollout-correction weights, the DP guard of the loss normaliser, and the named config errors."""

import math
import re
from typing import Any

import pytest
import torch
from conftest import compose_config

from megarl.algo import (
    PolicyLossInputs,
    batch_weight_mean,
    loss_normalizer,
    loss_param_problems,
    policy_loss,
    rollout_correction,
    rollout_correction_problems,
)
from megarl.algo.estimators_otb import otb_advantages
from megarl.config.algorithm import AlgorithmConfig, PolicyLossParams, RolloutCorrectionConfig


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _inputs(probs: list[float], old: list[float], adv: list[float]) -> tuple[PolicyLossInputs, torch.Tensor]:
    log_prob = torch.tensor([[math.log(p) for p in probs]], requires_grad=True)
    old_log_prob = torch.tensor([[math.log(p) for p in old]])
    return PolicyLossInputs(log_prob, old_log_prob, torch.tensor([adv]), torch.ones(1, len(probs))), log_prob


def _cfg(name: str, **params: Any) -> AlgorithmConfig:
    return AlgorithmConfig(policy_loss=name, loss_params=PolicyLossParams(**params))


def _grad(loss: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, log_prob)
    return grad


def test_dppo_tv_bounds_positive_and_negative_advantages_apart() -> None:
    # π − π_old = 0.2 (A > 0), 0.1 (A > 0), −0.04 (A < 0), −0.2 (A < 0); ratios 1.4, 1.2, 0.6, 7/9
    inputs, log_prob = _inputs([0.7, 0.6, 0.06, 0.7], [0.5, 0.5, 0.1, 0.9], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = policy_loss(inputs, _cfg("dppo_tv", dppo_tv_delta_high=0.25, dppo_tv_delta_low=0.03))
    # inside: tokens 0 and 1 (0.2, 0.1 <= 0.25); token 2 left δ_low (−0.04 < −0.03), token 3 too
    torch.testing.assert_close(loss, torch.tensor((-1.4 * math.log(0.7) - 1.2 * math.log(0.6)) / 4))
    assert float(metrics["pg_clipfrac_high"]) == 0 and float(metrics["pg_clipfrac_low"]) == 0.5
    torch.testing.assert_close(_grad(loss, log_prob), _t([[-0.35, -0.3, 0, 0]]))  # −A·r·v / 4
    symmetric, _ = policy_loss(inputs, _cfg("dppo_tv", dppo_tv_delta=0.15))
    both, _ = policy_loss(inputs, _cfg("dppo_tv", dppo_tv_delta_high=0.15, dppo_tv_delta_low=0.15))
    torch.testing.assert_close(both, symmetric)  # a single δ is the symmetric case
    torch.testing.assert_close(symmetric, torch.tensor((-1.2 * math.log(0.6) + 0.6 * math.log(0.06)) / 4))


def test_dppo_kl_bounds_positive_and_negative_advantages_apart() -> None:
    # binary KL from 0.5 to 0.7 or 0.3: 0.087; to 0.45: 0.005. δ_high = 0.1 keeps A > 0 up to 0.7; δ_low = 0.05
    # drops A < 0 down to 0.3; A > 0 down to 0.3 moved against A and A < 0 down to 0.45 is near: both inside
    inputs, _ = _inputs([0.7, 0.3, 0.3, 0.45], [0.5] * 4, [1.0, 1.0, -1.0, -1.0])
    loss, metrics = policy_loss(inputs, _cfg("dppo_kl", dppo_kl_delta_high=0.1, dppo_kl_delta_low=0.05))
    expected = (-1.4 * math.log(0.7) - 0.6 * math.log(0.3) + 0.9 * math.log(0.45)) / 4
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert float(metrics["pg_clipfrac_high"]) == 0 and float(metrics["pg_clipfrac_low"]) == 0.25
    flipped, flipped_metrics = policy_loss(inputs, _cfg("dppo_kl", dppo_kl_delta_high=0.05, dppo_kl_delta_low=0.1))
    expected = (-0.6 * math.log(0.3) + 0.6 * math.log(0.3) + 0.9 * math.log(0.45)) / 4
    torch.testing.assert_close(flipped, torch.tensor(expected))
    assert float(flipped_metrics["pg_clipfrac_high"]) == 0.25 and float(flipped_metrics["pg_clipfrac_low"]) == 0


def test_gmpo_clips_the_log_ratio_asymmetrically() -> None:
    """Log-ratios: sequence 0 (A = 1) 0.1, 0.6 → 0.1, 0.3 (above ε_high = 0.3); sequence 1 (A = −1) −0.6, 0.2 →
    −0.5 (below −ε_low = −0.5), 0.2. Sequence losses −Â·exp(mean), averaged over the two sequences."""
    log_prob = torch.tensor([[0.1, 0.6], [-0.6, 0.2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    inputs = PolicyLossInputs(log_prob, torch.zeros(2, 2), adv, torch.ones(2, 2))
    cfg = _cfg("gmpo", gmpo_log_clip_low=0.5, gmpo_log_clip_high=0.3)
    cfg.loss_agg_mode = "seq-mean-token-mean"
    loss, metrics = policy_loss(inputs, cfg)
    torch.testing.assert_close(loss, torch.tensor((-math.exp(0.2) + math.exp(-0.15)) / 2))
    assert float(metrics["pg_clipfrac_high"]) == 0.25 and float(metrics["pg_clipfrac_low"]) == 0.25
    symmetric = _cfg("gmpo", gmpo_log_clip=0.4)
    symmetric.loss_agg_mode = "seq-mean-token-mean"
    torch.testing.assert_close(policy_loss(inputs, symmetric)[0], torch.tensor((-math.exp(0.25) + math.exp(-0.1)) / 2))


def test_otb_without_the_zero_tail_lets_the_longest_be_its_own_baseline() -> None:
    """Group 0: row 0 (3 tokens, G = [3, 2, 1], W = [1, 2, 3]) and row 1 (1 token, G = 5, W = 1); group 1: row 2
    alone (G = [7, 7]). B_0 = (3 + 5) / 2 = 4. Past row 1, row 0 is alone: B = 0 with the zero tail, else
    B = G·W / (W + 1e-8) ≈ G. A group of one has B = 0 either way."""
    returns = _t([[3, 2, 1], [5, 0, 0], [7, 7, 0]])
    energy = _t([[1, 2, 3], [1, 0, 0], [1, 1, 0]])
    mask = _t([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    groups = torch.tensor([0, 0, 1])
    for per_model_token in (False, True):
        tail = otb_advantages(returns, energy, mask, groups, per_model_token)
        torch.testing.assert_close(tail, _t([[-1, 2, 1], [1, 0, 0], [7, 7, 0]]))
        own = otb_advantages(returns, energy, mask, groups, per_model_token, handle_zero_tail=False)
        torch.testing.assert_close(own, _t([[-1, 0, 0], [1, 0, 0], [7, 7, 0]]), atol=1e-6, rtol=0)


def _bypass_inputs() -> tuple[PolicyLossInputs, torch.Tensor]:
    """Row 0: π = [0.6, 0.5] over π_rollout = [0.5, 0.5] (ρ = 1.2, 1; sequence 1.2); row 1: π = [0.3, 0.4] over
    [0.1, 0.4] (ρ = 3, 1; sequence 3, geometric √3). All advantages 1."""
    log_prob = torch.log(_t([[0.6, 0.5], [0.3, 0.4]])).requires_grad_()
    rollout = torch.log(_t([[0.5, 0.5], [0.1, 0.4]]))
    inputs = PolicyLossInputs(log_prob, torch.full((2, 2), math.nan), torch.ones(2, 2), torch.ones(2, 2), rollout)
    return inputs, log_prob


def _bypass_loss(weights: list[list[float]]) -> torch.Tensor:
    return -(_t(weights) * _t([[0.6, 0.5], [0.3, 0.4]]).log()).mean()


@pytest.mark.parametrize(
    ("params", "weights", "frac_key", "frac"),
    [
        ({"bypass_is_level": "sequence"}, [[1.2, 1.2], [2.0, 2.0]], "rollout_is_capped_frac", 0.5),
        ({"bypass_is_level": "sequence", "bypass_is_lower": 0.5}, [[1.2, 1.2], [0, 0]], "rollout_is_masked_frac", 0.5),
        ({"bypass_is_lower": 0.5}, [[1.2, 1.0], [0, 1.0]], "rollout_is_masked_frac", 0.25),
        ({"bypass_is_level": "geometric"}, [[1.2**0.5] * 2, [3**0.5] * 2], "rollout_is_capped_frac", 0.0),
    ],
)
def test_bypass_sequence_weights_and_the_icepop_band(
    params: dict[str, Any], weights: list[list[float]], frac_key: str, frac: float
) -> None:
    inputs, _ = _bypass_inputs()
    loss, metrics = policy_loss(inputs, _cfg("bypass", bypass_is_cap=2.0, **params))
    torch.testing.assert_close(loss, _bypass_loss(weights))
    torch.testing.assert_close(metrics["rollout_is_weight_mean"], torch.tensor(sum(map(sum, weights)) / 4))
    assert float(metrics[frac_key]) == frac


def _ratios(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) log-probs with π_old/π_rollout = `rows`."""
    old = _t(rows).log()
    return old, torch.zeros_like(old)


@pytest.mark.parametrize(
    ("level", "mean", "expected"),
    [
        ("token", 1.25, [[1.2, 0.4], [1.6, 0.8]]),  # truncated weights 1.5, 0.5, 2, 1: mean 1.25
        ("sequence", 1.375, [[0.75 / 1.375] * 2, [2 / 1.375] * 2]),  # sequences 0.75 and 3 → 2: mean 1.375
    ],
)
def test_batch_normalised_weights_average_one_over_the_whole_batch(
    level: str, mean: float, expected: list[list[float]]
) -> None:
    old, rollout = _ratios([[1.5, 0.5], [3.0, 1.0]])
    mask = torch.ones(2, 2)
    cfg = RolloutCorrectionConfig(level=level, mode="truncate", upper=2.0, batch_normalize=True)
    torch.testing.assert_close(batch_weight_mean(old, rollout, mask, cfg), torch.tensor(mean))
    weights, _, metrics = rollout_correction(old, rollout, mask, cfg)
    torch.testing.assert_close(weights, _t(expected))
    torch.testing.assert_close(metrics["rollout_corr/batch_norm_factor"], torch.tensor(mean))
    # one micro-batch of row 1 with the whole batch's mean gets the whole batch's weights, not its own mean's
    column = torch.full((1,), mean)
    micro, _, _ = rollout_correction(old[1:], rollout[1:], mask[1:], cfg, column)
    torch.testing.assert_close(micro, _t(expected[1:]))


def test_batch_normalisation_reaches_the_policy_loss() -> None:
    """gpg's token loss −A·log π is 1 on every token (A = 1, log π = −1): the loss is the mean weight, 1 once
    normalised (the truncated weights 1.5, 0.5, 2, 1 average 1.25; the rollout_is_cap shorthand keeps the flag)."""
    old, rollout = _ratios([[1.5, 0.5], [3.0, 1.0]])
    inputs = PolicyLossInputs(torch.full((2, 2), -1.0), old, torch.ones(2, 2), torch.ones(2, 2), rollout)
    cfg = AlgorithmConfig(policy_loss="gpg", rollout_is_cap=2.0)
    torch.testing.assert_close(policy_loss(inputs, cfg)[0], torch.tensor(1.25))
    cfg.rollout_correction.batch_normalize = True
    loss, metrics = policy_loss(inputs, cfg)
    torch.testing.assert_close(loss, torch.tensor(1.0))
    torch.testing.assert_close(metrics["rollout_corr/batch_norm_factor"], torch.tensor(1.25))


def test_a_normaliser_over_several_dp_ranks_needs_the_global_counts() -> None:
    mask = _t([[1, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="num_dp_ranks=2 needs dp_counts"):
        loss_normalizer([mask], num_dp_ranks=2)
    norm = loss_normalizer([mask], num_dp_ranks=2, dp_counts=(7.0, 4.0))
    assert (norm.num_tokens, norm.num_seqs, norm.num_dp_ranks, norm.norm_length) == (7.0, 4.0, 2, 3)
    assert loss_normalizer([mask]).num_tokens == 3.0  # one rank: its own masks


@pytest.mark.parametrize(
    ("loss", "params", "message"),
    [
        ("dppo_tv", {"dppo_tv_delta_high": -0.1}, "loss_params.dppo_tv_delta_high=-0.1 must be > 0"),
        ("dppo_kl", {"dppo_kl_delta_low": 0.0}, "loss_params.dppo_kl_delta_low=0.0 must be > 0"),
        ("gmpo", {"gmpo_log_clip_low": -1.0}, "loss_params.gmpo_log_clip_low=-1.0 must be > 0"),
        ("bypass", {"bypass_is_level": "turn"}, "bypass_is_level='turn' is unknown; choose one of token, sequence"),
        ("bypass", {"bypass_is_lower": 0.5, "bypass_is_cap": None}, "bypass_is_cap is null; set both"),
        ("bypass", {"bypass_is_lower": 3.0}, "bypass_is_lower=3.0 must be in \\[0, bypass_is_cap=2.0\\)"),
        ("dro", {}, "needs algorithm.loss_params.dro_beta > 0"),
    ],
)
def test_loss_params_errors_name_the_key(loss: str, params: dict[str, Any], message: str) -> None:
    problems = loss_param_problems(_cfg(loss, **params))
    assert len(problems) == 1 and re.search(message, problems[0]), problems
    assert loss_param_problems(_cfg("ppo", **params)) == []  # only the chosen loss's knobs are checked


def test_batch_normalize_without_a_level_is_refused() -> None:
    cfg = AlgorithmConfig()
    cfg.rollout_correction.batch_normalize = True
    assert rollout_correction_problems(cfg) == [
        "algorithm.rollout_correction.batch_normalize=true but algorithm.rollout_correction.level=none turns the "
        "correction off; choose a level"
    ]
    cfg.rollout_is_cap = 2.0  # the shorthand is a token-level correction: fine
    assert rollout_correction_problems(cfg) == []


def test_the_knobs_compose_from_the_command_line() -> None:
    cfg = compose_config(
        "algorithm.policy_loss=dppo_tv",
        "algorithm.loss_params.dppo_tv_delta_high=0.28",
        "algorithm.loss_params.dppo_tv_delta_low=0.2",
        "algorithm.loss_params.bypass_is_level=sequence",
        "algorithm.loss_params.bypass_is_lower=0.5",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.batch_normalize=true",
        "algorithm.otb_handle_zero_tail=false",
    )
    params = cfg.algorithm.loss_params
    assert (params.dppo_tv_delta_high, params.dppo_tv_delta_low, params.bypass_is_lower) == (0.28, 0.2, 0.5)
    assert cfg.algorithm.rollout_correction.batch_normalize and not cfg.algorithm.otb_handle_zero_tail
