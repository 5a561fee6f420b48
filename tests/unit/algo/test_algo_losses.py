"""Policy and value losses, aggregation modes (incl. gradient accumulation), log-probs and entropy."""

import math

import pytest
import torch

from megarl.algo import (
    LOSS_AGG_MODES,
    LossNormalizer,
    PolicyLossInputs,
    actor_loss,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
    loss_normalizer,
    policy_loss,
    value_loss,
)
from megarl.config import AlgorithmConfig


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _ppo_inputs(ratios: list[float], advantages: list[float]) -> tuple[PolicyLossInputs, torch.Tensor]:
    log_prob = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    inputs = PolicyLossInputs(
        log_prob=log_prob,
        old_log_prob=torch.zeros(1, len(ratios)),
        advantages=torch.tensor([advantages]),
        response_mask=torch.ones(1, len(ratios)),
    )
    return inputs, log_prob


def test_ppo_clip_and_dual_clip_by_hand() -> None:
    inputs, log_prob = _ppo_inputs([1.5, 0.5, 1.1, 5.0], [1.0, -1.0, 1.0, -1.0])
    loss, metrics = policy_loss(inputs, AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0))
    # token losses: clipped high −1.2, clipped low 0.8, unclipped −1.1, dual-clipped min(5, 3) = 3
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8 - 1.1 + 3.0) / 4))
    assert float(metrics["pg_clipfrac_high"]) == 0.25
    assert float(metrics["pg_clipfrac_low"]) == 0.25
    assert float(metrics["pg_clipfrac_dual"]) == 0.25
    expected_kl = -sum(math.log(r) for r in [1.5, 0.5, 1.1, 5.0]) / 4
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(expected_kl))
    loss.backward()
    # only the unclipped token has a gradient: d(−A·r)/dlog π = −A·r = −1.1, over 4 tokens
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, _t([[0, 0, -1.1 / 4, 0]]))


def test_ppo_separate_low_and_high_clip() -> None:
    inputs, _ = _ppo_inputs([1.25, 0.75], [1.0, -1.0])
    loss, metrics = policy_loss(inputs, AlgorithmConfig(clip_ratio_low=0.1, clip_ratio_high=0.28))
    # 1.25 < 1.28: unclipped −1.25; 0.75 < 0.9 with A < 0: clipped to 0.9
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.9) / 2))
    assert float(metrics["pg_clipfrac_high"]) == 0 and float(metrics["pg_clipfrac_low"]) == 0.5


def test_gspo_uses_the_sequence_ratio() -> None:
    log_prob = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), math.log(1.5)]], requires_grad=True)
    inputs = PolicyLossInputs(
        log_prob=log_prob, old_log_prob=torch.zeros(2, 2), advantages=torch.ones(2, 2), response_mask=torch.ones(2, 2)
    )
    cfg = AlgorithmConfig(
        policy_loss="gspo", clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-mean"
    )
    loss, metrics = policy_loss(inputs, cfg)
    s0 = math.sqrt(0.75)  # exp(mean(log 1.5, log 0.5)), inside the clip range; sequence 1 (1.5) clips to 1.2
    torch.testing.assert_close(loss, torch.tensor((-s0 - 1.2) / 2))
    assert float(metrics["pg_clipfrac_high"]) == 0.5
    loss.backward()
    # d(−s)/dlog π_t = −s/|y| per token, averaged over 2 sequences; the clipped sequence has none
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, _t([[-s0 / 4, -s0 / 4], [0, 0]]))


def test_truncated_importance_sampling_weights_and_caps() -> None:
    inputs, _ = _ppo_inputs([1.0, 1.0], [1.0, 1.0])
    inputs = PolicyLossInputs(
        log_prob=inputs.log_prob,
        old_log_prob=inputs.old_log_prob,
        advantages=inputs.advantages,
        response_mask=inputs.response_mask,
        rollout_log_prob=torch.tensor([[math.log(2.0), -math.log(3.0)]]),
    )
    loss, metrics = policy_loss(inputs, AlgorithmConfig(rollout_is_cap=2.0))
    # weights π_old/π_rollout = [0.5, 3 → capped at 2]; token losses −1 each
    torch.testing.assert_close(loss, torch.tensor((-0.5 - 2.0) / 2))
    torch.testing.assert_close(metrics["rollout_is_weight_mean"], torch.tensor(1.25))
    assert float(metrics["rollout_is_capped_frac"]) == 0.5
    with pytest.raises(ValueError, match="rollout_is_cap"):
        policy_loss(_ppo_inputs([1.0], [1.0])[0], AlgorithmConfig(rollout_is_cap=2.0))


LOSS = _t([[1, 2, 3], [4, 0, 0], [7, 7, 7]])
MASK = _t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is all padding


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),
    ],
)
def test_aggregation_modes_by_hand(mode: str, expected: float) -> None:
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_aggregation_of_nothing_is_zero() -> None:
    for mode in LOSS_AGG_MODES:
        assert float(aggregate_loss(LOSS, torch.zeros_like(MASK), mode)) == 0.0


def test_sum_norm_uses_the_configured_length_not_the_padded_width() -> None:
    norm = loss_normalizer([MASK], norm_length=10)
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm), torch.tensor(0.5))


def _random_loss(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(6, 9, generator=gen) > 0.4).float()
    mask[2] = 0
    return torch.randn(6, 9, generator=gen), mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_with_the_global_normalizer_sum_to_the_whole_batch(mode: str, seed: int) -> None:
    loss, mask = _random_loss(seed)
    whole = aggregate_loss(loss, mask, mode, loss_normalizer([mask], norm_length=9))
    parts = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]
    norm = loss_normalizer([m for _, m in parts], norm_length=9)
    torch.testing.assert_close(sum(aggregate_loss(lo, m, mode, norm) for lo, m in parts), whole)
    if mode != "seq-mean-token-sum":  # a per-micro-batch normaliser is wrong whenever the split is uneven
        naive = sum(aggregate_loss(lo, m, mode, loss_normalizer([m], norm_length=9)) for lo, m in parts) / 2
        assert not torch.allclose(naive, whole)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_average_equals_the_whole_batch(mode: str) -> None:
    loss, mask = _random_loss(7)
    whole = aggregate_loss(loss, mask, mode)
    local = loss_normalizer([mask])
    norm = LossNormalizer(
        num_tokens=local.num_tokens, num_seqs=local.num_seqs, norm_length=local.norm_length, num_dp_ranks=2
    )  # counts summed over both ranks
    ranks = [aggregate_loss(loss[:4], mask[:4], mode, norm), aggregate_loss(loss[4:], mask[4:], mode, norm)]
    torch.testing.assert_close((ranks[0] + ranks[1]) / 2, whole)  # DDP averages the ranks' gradients


def test_actor_loss_adds_entropy_and_kl_terms() -> None:
    inputs, _ = _ppo_inputs([1.0, 1.0], [1.0, -1.0])
    ref = torch.tensor([[-0.5, 0.5]])
    entropy = torch.tensor([[2.0, 4.0]])
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", entropy_coeff=0.01)
    loss, metrics = actor_loss(inputs, cfg, entropy=entropy, ref_log_prob=ref)
    kl = kl_penalty(inputs.log_prob, ref, "k2").mean()  # 0.5·0.25 per token
    torch.testing.assert_close(kl, torch.tensor(0.125))
    torch.testing.assert_close(loss, torch.tensor(0.0) - 0.01 * 3.0 + 0.1 * 0.125)
    assert set(metrics) >= {"pg_loss", "entropy", "kl_loss", "pg_clipfrac_high", "ppo_kl"}
    with pytest.raises(ValueError, match="reference log-probs"):
        actor_loss(inputs, cfg, entropy=entropy)
    with pytest.raises(ValueError, match="entropy_coeff"):
        actor_loss(inputs, AlgorithmConfig(entropy_coeff=0.01))


def test_value_loss_clips_by_hand() -> None:
    loss, metrics = value_loss(
        values=_t([[1.0, 2.0]]),
        old_values=_t([[0.5, 0.5]]),
        returns=_t([[1.5, 0.0]]),
        response_mask=_t([[1, 1]]),
        cliprange_value=0.2,
        loss_agg_mode="token-mean",
    )
    # token 0: clipped 0.7 → max(0.25, 0.64); token 1: clipped 0.7 → max(4, 0.49); halved, averaged
    torch.testing.assert_close(loss, torch.tensor((0.32 + 2.0) / 2))
    assert float(metrics["vf_clipfrac"]) == 0.5


def test_log_probs_and_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    expected_log_p = torch.log(torch.tensor([0.75, 0.5]))
    torch.testing.assert_close(log_probs_from_logits(logits, torch.tensor([1, 0])), expected_log_p)
    expected_h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([expected_h, math.log(2.0)]))
    # temperature divides the logits before the softmax
    torch.testing.assert_close(log_probs_from_logits(logits * 2, torch.tensor([1, 0]), temperature=2.0), expected_log_p)
    big = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    reference = torch.log_softmax(big, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(log_probs_from_logits(big.to(torch.bfloat16), labels), reference, atol=0.05, rtol=0)
