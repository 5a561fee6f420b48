"""Rollout correction: levels × modes on hand-computed ratios, veto, NaN padding, the rollout_is_cap shorthand,
config problems, and its effect on a policy loss's gradient."""

import dataclasses
import itertools
import math

import pytest
import torch

from megarl.algo import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossInputs,
    aggregate_loss,
    policy_loss,
    resolve_rollout_correction,
    rollout_correction,
    rollout_correction_problems,
)
from megarl.config import AlgorithmConfig
from megarl.config.algorithm import RolloutCorrectionConfig

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "reject")


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _run(
    ratios: list[list[float]], mask: list[list[float]] | None = None, **cfg: object
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Correction with π_old/π_rollout = `ratios` (old = log ratio, rollout = 0)."""
    old = _t(ratios).log()
    response_mask = _t(mask) if mask is not None else torch.ones_like(old)
    return rollout_correction(old, torch.zeros_like(old), response_mask, RolloutCorrectionConfig(**cfg))  # type: ignore[arg-type]


def test_token_truncate_weights_and_metrics() -> None:
    weights, mask, m = _run([[0.5, 3.0, 1.0]], level="token", mode="truncate", upper=2.0)
    torch.testing.assert_close(weights, _t([[0.5, 2.0, 1.0]]))
    torch.testing.assert_close(mask, _t([[1, 1, 1]]))
    torch.testing.assert_close(m["rollout_corr/truncated_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["rollout_corr/weight_mean"], torch.tensor(3.5 / 3))
    torch.testing.assert_close(m["rollout_corr/weight_max"], torch.tensor(2.0))
    torch.testing.assert_close(m["rollout_corr/ess"], torch.tensor(3.5**2 / (3 * 5.25)))
    torch.testing.assert_close(m["rollout_corr/kl"], torch.tensor(-math.log(1.5) / 3))
    torch.testing.assert_close(m["rollout_corr/chi2"], torch.tensor((0.25 + 9 + 1) / 3 - 1))
    assert float(m["rollout_corr/vetoed_seq_frac"]) == 0.0


def test_token_truncate_with_lower_bound() -> None:
    weights, _, m = _run([[0.5, 3.0, 1.0]], level="token", mode="truncate", upper=2.0, lower=0.8)
    torch.testing.assert_close(weights, _t([[0.8, 2.0, 1.0]]))
    torch.testing.assert_close(m["rollout_corr/truncated_frac"], torch.tensor(2 / 3))


def test_token_mask_and_reject_default_lower_is_reciprocal() -> None:
    ratios = [[0.4, 3.0, 1.0, 0.5]]  # lower = 1/2: 0.4 and 3 are out, 0.5 is in (bounds inclusive)
    weights, mask, m = _run(ratios, level="token", mode="mask", upper=2.0)
    torch.testing.assert_close(mask, _t([[0, 0, 1, 1]]))
    torch.testing.assert_close(weights, _t([[0, 0, 1.0, 0.5]]))
    torch.testing.assert_close(m["rollout_corr/masked_frac"], torch.tensor(0.5))
    torch.testing.assert_close(m["rollout_corr/weight_mean"], torch.tensor(0.75))
    weights, mask, _ = _run(ratios, level="token", mode="reject", upper=2.0)
    torch.testing.assert_close(mask, _t([[0, 0, 1, 1]]))
    torch.testing.assert_close(weights, _t([[0, 0, 1, 1]]))


def test_sequence_level_uses_the_product_of_token_ratios() -> None:
    ratios, pad = [[2.0, 2.0, 7.0], [0.5, 1.5, 7.0]], [[1, 1, 0], [1, 1, 0]]  # ρ = 4 and 0.75
    weights, _, m = _run(ratios, pad, level="sequence", mode="truncate", upper=2.0)
    torch.testing.assert_close(weights, _t([[2, 2, 0], [0.75, 0.75, 0]]))
    torch.testing.assert_close(m["rollout_corr/truncated_frac"], torch.tensor(0.5))
    weights, mask, m = _run(ratios, pad, level="sequence", mode="mask", upper=2.0)
    torch.testing.assert_close(mask, _t([[0, 0, 0], [1, 1, 0]]))
    torch.testing.assert_close(weights, _t([[0, 0, 0], [0.75, 0.75, 0]]))
    torch.testing.assert_close(m["rollout_corr/masked_frac"], torch.tensor(0.5))


def test_geometric_level_hand_computed() -> None:
    ratios = [[4.0, 1.0], [0.25, 1.0], [1.0, 9.0]]  # geometric means 2, 0.5, 3
    weights, _, _ = _run(ratios, level="geometric", mode="truncate", upper=2.5)
    torch.testing.assert_close(weights, _t([[2, 2], [0.5, 0.5], [2.5, 2.5]]))
    weights, mask, m = _run(ratios, level="geometric", mode="reject", upper=2.5, lower=0.4)
    torch.testing.assert_close(mask, _t([[1, 1], [1, 1], [0, 0]]))
    torch.testing.assert_close(weights, mask)
    torch.testing.assert_close(m["rollout_corr/masked_frac"], torch.tensor(1 / 3))


def test_geometric_level_is_exp_of_mean_log_ratio_per_sequence() -> None:
    gen = torch.Generator().manual_seed(0)
    old, rollout = -torch.rand(5, 7, generator=gen), -torch.rand(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    cfg = RolloutCorrectionConfig(level="geometric", mode="truncate", upper=1e6)
    weights, _, _ = rollout_correction(old, rollout, mask, cfg)
    expected = (((old - rollout) * mask).sum(-1) / mask.sum(-1)).exp()  # [b]
    torch.testing.assert_close(weights, expected.unsqueeze(-1) * mask)


@pytest.mark.parametrize(("level", "mode"), list(itertools.product(LEVELS, MODES)))
def test_equal_policies_give_unit_weights_and_keep_every_token(level: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(3 * LEVELS.index(level) + MODES.index(mode))
    log_prob = -5 * torch.rand(4, 9, generator=gen)
    mask = (torch.rand(4, 9, generator=gen) > 0.4).float()
    cfg = RolloutCorrectionConfig(level=level, mode=mode, upper=1.5, veto_threshold=1e-4)
    weights, kept, m = rollout_correction(log_prob, log_prob.clone(), mask, cfg)
    assert torch.equal(kept, mask)
    assert torch.equal(weights, mask)  # exactly 1 on model tokens, 0 on padding
    frac = "truncated_frac" if mode == "truncate" else "masked_frac"
    for name in (frac, "kl", "chi2", "vetoed_seq_frac"):
        assert float(m[f"rollout_corr/{name}"]) == 0.0, name
    torch.testing.assert_close(m["rollout_corr/ess"], torch.tensor(1.0))


@pytest.mark.parametrize(("level", "mode"), list(itertools.product(LEVELS, MODES)))
def test_veto_removes_the_whole_sequence(level: str, mode: str) -> None:
    ratios = [[1.0, 1e-5, 1.0], [1.0, 1.2, 1.0]]
    weights, mask, m = _run(ratios, level=level, mode=mode, upper=1e9, lower=1e-12, veto_threshold=1e-4)
    assert torch.equal(mask[0], torch.zeros(3)) and torch.equal(weights[0], torch.zeros(3))
    assert torch.equal(mask[1], torch.ones(3))
    torch.testing.assert_close(m["rollout_corr/vetoed_seq_frac"], torch.tensor(0.5))


def test_veto_ignores_padding() -> None:
    _, mask, m = _run([[1.0, 1e-9]], [[1, 0]], level="token", veto_threshold=1e-4)
    torch.testing.assert_close(mask, _t([[1, 0]]))
    assert float(m["rollout_corr/vetoed_seq_frac"]) == 0.0


@pytest.mark.parametrize(("level", "mode"), list(itertools.product(LEVELS, MODES)))
def test_nan_padding_does_not_leak(level: str, mode: str) -> None:
    old, rollout = _t([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]]), _t([[-1.2, -0.4, 0.0], [-1.9, 0.0, 0.0]])
    mask = _t([[1, 1, 0], [1, 0, 0]])
    cfg = RolloutCorrectionConfig(level=level, mode=mode, upper=1.1, veto_threshold=1e-3)
    clean = rollout_correction(old, rollout, mask, cfg)
    nan = torch.tensor(float("nan"))
    dirty = rollout_correction(torch.where(mask.bool(), old, nan), torch.where(mask.bool(), rollout, -nan), mask, cfg)
    torch.testing.assert_close(dirty[0], clean[0])
    torch.testing.assert_close(dirty[1], clean[1])
    for name, value in clean[2].items():
        torch.testing.assert_close(dirty[2][name], value, msg=name)
        assert torch.isfinite(value), name


def _inputs(rollout_log_prob: torch.Tensor | None, seed: int = 0) -> PolicyLossInputs:
    gen = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(3, 5, generator=gen)
    mask = _t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    return PolicyLossInputs(
        log_prob=(old + 0.1 * torch.randn(3, 5, generator=gen)).requires_grad_(),
        old_log_prob=old,
        advantages=torch.randn(3, 5, generator=gen),
        response_mask=mask,
        rollout_log_prob=rollout_log_prob,
    )


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_rollout_is_cap_matches_the_old_truncated_is(agg: str) -> None:
    probe = _inputs(None)
    rollout = probe.old_log_prob + 0.8 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    inputs = dataclasses.replace(probe, rollout_log_prob=rollout)
    cfg = AlgorithmConfig(rollout_is_cap=1.5, loss_agg_mode=agg)
    loss, metrics = policy_loss(inputs, cfg)
    ratio = (inputs.old_log_prob - rollout).clamp(-20, 20).exp()  # the formula before rollout_correction
    old_weight = ratio.clamp(max=1.5)
    token_loss, _ = POLICY_LOSSES.get("ppo")(inputs, cfg)
    torch.testing.assert_close(loss, aggregate_loss(token_loss * old_weight, inputs.response_mask, agg))
    mask = inputs.response_mask
    torch.testing.assert_close(metrics["rollout_is_weight_mean"], (old_weight * mask).sum() / mask.sum())
    torch.testing.assert_close(metrics["rollout_is_capped_frac"], ((ratio > 1.5) * mask).sum() / mask.sum())
    shorthand = resolve_rollout_correction(cfg)
    assert shorthand is not None and (shorthand.level, shorthand.mode, shorthand.upper) == ("token", "truncate", 1.5)


def test_policy_loss_gradients_are_scaled_by_weights_and_masked_tokens_get_none() -> None:
    old = torch.zeros(1, 4)
    inputs = PolicyLossInputs(
        log_prob=old.clone().requires_grad_(),  # π = π_old: ppo's token gradient is −A
        old_log_prob=old,
        advantages=torch.ones(1, 4),
        response_mask=torch.ones(1, 4),
        rollout_log_prob=-_t([[0.4, 1.5, 1.0, 0.8]]).log(),  # π_old/π_rollout = these
    )
    cfg = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(level="token", mode="mask", upper=2.0))
    loss, metrics = policy_loss(inputs, cfg)
    loss.backward()
    assert inputs.log_prob.grad is not None
    # 0.4 < 1/2 is rejected; token-mean still divides by the 4 model tokens
    torch.testing.assert_close(inputs.log_prob.grad, _t([[0.0, -1.5 / 4, -1.0 / 4, -0.8 / 4]]))
    torch.testing.assert_close(loss, torch.tensor(-(1.5 + 1.0 + 0.8) / 4))
    torch.testing.assert_close(metrics["rollout_corr/masked_frac"], torch.tensor(0.25))
    assert "rollout_is_weight_mean" not in metrics


def test_policy_loss_without_rollout_log_probs_names_the_key() -> None:
    cfg = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(level="sequence"))
    with pytest.raises(ValueError, match="rollout_correction.level"):
        policy_loss(_inputs(None), cfg)
    inputs, off_cfg = _inputs(None), AlgorithmConfig()  # level=none: the plain aggregated loss, no metrics
    off, metrics = policy_loss(inputs, off_cfg)
    token_loss, _ = POLICY_LOSSES.get("ppo")(inputs, off_cfg)
    torch.testing.assert_close(off, aggregate_loss(token_loss, inputs.response_mask, "token-mean"))
    assert not any(name.startswith("rollout_corr/") for name in metrics)


def test_problems_name_the_keys() -> None:
    assert rollout_correction_problems(AlgorithmConfig()) == []
    assert rollout_correction_problems(AlgorithmConfig(rollout_is_cap=2.0)) == []
    both = AlgorithmConfig(rollout_is_cap=2.0, rollout_correction=RolloutCorrectionConfig(level="token"))
    [message] = rollout_correction_problems(both)
    assert "algorithm.rollout_is_cap" in message and "algorithm.rollout_correction.level" in message
    with pytest.raises(ValueError, match="rollout_is_cap and algorithm.rollout_correction.level"):
        policy_loss(_inputs(torch.zeros(3, 5)), both)
    bad = RolloutCorrectionConfig(level="seq", mode="clip", upper=0.0, lower=1.0, veto_threshold=0.0)
    problems = rollout_correction_problems(AlgorithmConfig(rollout_correction=bad))
    for key in ("level", "mode", "upper", "lower", "veto_threshold"):
        assert any(f"algorithm.rollout_correction.{key}=" in p for p in problems), key
    veto_only = RolloutCorrectionConfig(veto_threshold=1e-4)
    assert rollout_correction_problems(AlgorithmConfig(rollout_correction=veto_only))
    bypass = AlgorithmConfig(policy_loss="bypass", rollout_correction=RolloutCorrectionConfig(level="token"))
    assert any("bypass" in p for p in rollout_correction_problems(bypass))


def test_seq_mean_token_mean_averages_over_kept_tokens_and_ignores_inf_on_rejected() -> None:
    inputs = PolicyLossInputs(
        log_prob=torch.zeros(1, 4, requires_grad=True),
        old_log_prob=torch.zeros(1, 4),
        advantages=_t([[1.0, 1.0, 1.0, float("inf")]]),  # the rejected last token's loss is inf
        response_mask=torch.ones(1, 4),
        rollout_log_prob=-_t([[1.5, 1.0, 0.8, 3.0]]).log(),
    )
    rc = RolloutCorrectionConfig(level="token", mode="mask", upper=2.0)
    loss, _ = policy_loss(inputs, AlgorithmConfig(rollout_correction=rc, loss_agg_mode="seq-mean-token-mean"))
    torch.testing.assert_close(loss, torch.tensor(-(1.5 + 1.0 + 0.8) / 3))
