"""Loss aggregation: how a `[b, t]` matrix of token losses becomes the number that is back-propagated.

`algorithm.loss_agg_mode` picks one of (m_it = response mask, n_i = Σ_t m_it, N = Σ_i n_i,
S = sequences with n_i > 0, L = `norm_length`):

- `token-mean`:               Σ_it m·ℓ / N                       (every token weighs the same)
- `token-sum`:                Σ_it m·ℓ                           (no normaliser: the step grows with the tokens)
- `seq-mean-token-sum`:       Σ_i (Σ_t m·ℓ) / S                  (longer answers weigh more)
- `seq-mean-token-mean`:      Σ_i (Σ_t m·ℓ / n_i) / S            (every sequence weighs the same)
- `seq-mean-token-sum-norm`:  Σ_i (Σ_t m·ℓ / L) / S              (Dr.GRPO: a constant length, no length bias)

Gradient accumulation: one optimizer step may run several micro-batches (and data-parallel
ranks). The normaliser N or S must then be the count over the whole mini-batch, not per
micro-batch, or short micro-batches get inflated weight. Build one `LossNormalizer` from all the
micro-batch masks of the mini-batch (summing the counts over the DP group), pass it to every
micro-batch, and the summed micro-batch losses equal the loss of the whole mini-batch at once.
`token-sum` divides by nothing, so it is already additive over micro-batches; its `num_dp_ranks`
factor (like every mode's) turns DDP's average over ranks into the sum over all ranks' tokens,
so `token-sum` is the sum of the token losses of the whole mini-batch (as verl 0.9's `token-sum`).

Token losses outside the mask are never read (`masked_sum`): NaN or inf there changes nothing.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from megarl.algo.stats import masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True, slots=True)
class LossNormalizer:
    num_tokens: float
    """Model tokens in the whole mini-batch (all micro-batches, all DP ranks)."""
    num_seqs: float
    """Sequences with at least one model token, same scope."""
    norm_length: float
    """L of seq-mean-token-sum-norm: a constant, normally data.max_response_length."""
    num_dp_ranks: int = 1
    """DDP averages gradients over ranks; the loss is multiplied by this so the result is a global sum / count."""


def loss_normalizer(
    response_masks: Sequence[Tensor],
    norm_length: float | None = None,
    num_dp_ranks: int = 1,
    dp_counts: tuple[float, float] | None = None,
) -> LossNormalizer:
    """Counts over the micro-batch masks of one mini-batch; `norm_length` defaults to their width.

    The masks are this rank's; with `num_dp_ranks` > 1 the counts must cover every DP rank, so `dp_counts`
    (model tokens, sequences with model tokens; each summed over the DP group) is then required: counting
    one rank's masks would scale every rank's loss by the DP size.
    """
    if dp_counts is None and num_dp_ranks > 1:
        raise ValueError(
            f"loss_normalizer: num_dp_ranks={num_dp_ranks} needs dp_counts, the token and sequence counts summed "
            "over the DP group (all-reduce them, as MegatronEngine does); this rank's masks cover one rank only"
        )
    if dp_counts is not None:
        num_tokens, num_seqs = dp_counts
    else:
        num_tokens = sum(float(mask.sum()) for mask in response_masks)
        num_seqs = sum(float((mask.sum(dim=-1) > 0).sum()) for mask in response_masks)
    length = norm_length if norm_length is not None else max(mask.shape[-1] for mask in response_masks)
    return LossNormalizer(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=length, num_dp_ranks=num_dp_ranks)


def aggregate_loss(
    loss_mat: Tensor, response_mask: Tensor, mode: str, normalizer: LossNormalizer | None = None
) -> Tensor:
    """Aggregate token losses `[b, t]` by `mode`; without `normalizer`, this batch is the whole mini-batch.

    An empty normaliser (no model tokens) gives 0, never NaN.
    """
    norm = normalizer if normalizer is not None else loss_normalizer([response_mask])
    mask = response_mask.to(loss_mat.dtype)
    token_sums = masked_sum(loss_mat, mask, dim=-1)  # [b]
    if mode == "token-mean":
        total, count = token_sums.sum(), norm.num_tokens
    elif mode == "token-sum":
        total, count = token_sums.sum(), 1.0
    elif mode == "seq-mean-token-sum":
        total, count = token_sums.sum(), norm.num_seqs
    elif mode == "seq-mean-token-mean":
        total, count = (token_sums / mask.sum(dim=-1).clamp_min(1)).sum(), norm.num_seqs
    elif mode == "seq-mean-token-sum-norm":
        total, count = token_sums.sum() / norm.norm_length, norm.num_seqs
    else:
        raise ValueError(f"algorithm.loss_agg_mode={mode!r} is unknown; choose one of {', '.join(LOSS_AGG_MODES)}")
    return total * norm.num_dp_ranks / max(count, 1.0)
