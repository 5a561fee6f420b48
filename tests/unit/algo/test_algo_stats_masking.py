"""Masked statistics and loss aggregation never read what sits outside the mask: NaN and inf padding
change neither the values nor the gradients of the masked-in entries."""

import math

import pytest
import torch

from megarl.algo import (
    LOSS_AGG_MODES,
    LossNormalizer,
    aggregate_loss,
    loss_normalizer,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
CLEAN = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
PADDINGS = [math.nan, math.inf, -math.inf]


def _padded(fill: float) -> torch.Tensor:
    """CLEAN with `fill` at every position off MASK, as a leaf that records gradients."""
    return torch.where(MASK.bool(), CLEAN, fill).requires_grad_()


STATISTICS = {
    "masked_sum": lambda x: masked_sum(x, MASK),
    "masked_sum_rows": lambda x: masked_sum(x, MASK, dim=-1),
    "masked_mean": lambda x: masked_mean(x, MASK),
    "masked_mean_rows": lambda x: masked_mean(x, MASK, dim=-1),
    "masked_var": lambda x: masked_var(x, MASK),
    "masked_var_biased": lambda x: masked_var(x, MASK, unbiased=False),
    "masked_whiten": lambda x: masked_whiten(x, MASK),
}


def test_statistics_by_hand() -> None:
    assert float(masked_sum(CLEAN, MASK)) == 8.0
    assert masked_sum(CLEAN, MASK, dim=-1).tolist() == [4.0, 4.0, 0.0]
    assert masked_mean(CLEAN, MASK, dim=-1).tolist() == [2.0, 4.0, 0.0]
    torch.testing.assert_close(masked_var(CLEAN, MASK), torch.tensor(7 / 3))  # unbiased over [1, 3, 4]
    white = (torch.tensor([1.0, 3.0, 4.0]) - 8 / 3) / math.sqrt(7 / 3 + 1e-6)
    torch.testing.assert_close(masked_whiten(CLEAN, MASK)[MASK.bool()], white)


@pytest.mark.parametrize("fill", PADDINGS)
@pytest.mark.parametrize("name", STATISTICS)
def test_statistics_ignore_nan_and_inf_padding(name: str, fill: float) -> None:
    fn = STATISTICS[name]
    clean, padded = CLEAN.clone().requires_grad_(), _padded(fill)
    expected, got = fn(clean), fn(padded)
    torch.testing.assert_close(got, expected)
    weights = torch.linspace(0.5, 1.5, expected.numel()).reshape(expected.shape)  # a non-uniform upstream gradient
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    assert clean.grad is not None and padded.grad is not None
    assert torch.isfinite(padded.grad).all()
    torch.testing.assert_close(padded.grad[MASK.bool()], clean.grad[MASK.bool()])
    assert (padded.grad[~MASK.bool()] == 0).all()


def test_whiten_zeroes_the_padding_even_when_it_is_nan() -> None:
    white = masked_whiten(_padded(math.nan), MASK)
    assert (white[~MASK.bool()] == 0).all()


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_sum_by_hand() -> None:
    torch.testing.assert_close(aggregate_loss(LOSS, LOSS_MASK, "token-sum"), torch.tensor(10.0))
    # Two micro-batches: the sums add up, and no normaliser is involved.
    norm = loss_normalizer([LOSS_MASK[:1], LOSS_MASK[1:]])
    parts = aggregate_loss(LOSS[:1], LOSS_MASK[:1], "token-sum", norm) + aggregate_loss(
        LOSS[1:], LOSS_MASK[1:], "token-sum", norm
    )
    torch.testing.assert_close(parts, torch.tensor(10.0))
    # Two DP ranks: each rank's sum is doubled, so DDP's average of the ranks is the global sum.
    two_ranks = LossNormalizer(num_tokens=4.0, num_seqs=2.0, norm_length=3.0, num_dp_ranks=2)
    rank0 = aggregate_loss(LOSS[:1], LOSS_MASK[:1], "token-sum", two_ranks)
    rank1 = aggregate_loss(LOSS[1:], LOSS_MASK[1:], "token-sum", two_ranks)
    torch.testing.assert_close(rank0, torch.tensor(12.0))
    torch.testing.assert_close((rank0 + rank1) / 2, torch.tensor(10.0))


@pytest.mark.parametrize("fill", PADDINGS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_ignores_nan_and_inf_padding(mode: str, fill: float) -> None:
    clean = LOSS.clone().requires_grad_()
    padded = torch.where(LOSS_MASK.bool(), LOSS, fill).requires_grad_()
    expected, got = aggregate_loss(clean, LOSS_MASK, mode), aggregate_loss(padded, LOSS_MASK, mode)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    assert clean.grad is not None and padded.grad is not None
    assert torch.isfinite(padded.grad).all()
    torch.testing.assert_close(padded.grad, clean.grad)
