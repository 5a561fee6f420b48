"""Masked statistics that ignore padding and never produce NaN.

Masks are 0/1 (bool, int or float). Whatever sits outside the mask is never read: positions are
selected with `torch.where`, not multiplied by the mask, so NaN or inf padding (0·NaN = NaN)
cannot leak into a result or into the gradient of a masked-in element.

Conventions (tested): a mean over nothing is 0; a variance over fewer than two elements is 0;
whitening therefore maps an all-masked row or a single element to 0. Group statistics use
`group_ids` `[b]` (any integers; equal id = same prompt): a group of one sample has mean equal
to its value and std 0, so group-relative advantages are 0 for it.
"""

import torch
from torch import Tensor

EPS = 1e-6
"""Added to standard deviations before dividing."""


def zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where `mask` is set, 0 elsewhere (even where `x` is NaN or inf); gradients pass only where set.

    Apply it to an input before any arithmetic on it: a masked-out NaN that reaches an op's backward
    turns that op's zero gradient into 0·NaN = NaN.
    """
    return torch.where(mask.bool(), x, 0.0)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ of the masked elements of `x` over `dim` (all elements when None)."""
    masked = zero_outside(x, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ masked x / Σ mask over `dim`; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements of `x` (scalar); 0 for fewer than two (unbiased) or zero elements."""
    x = zero_outside(x, mask)  # finite padding: the squares' backward must not see NaN there
    count = mask.sum()
    mean = masked_mean(x, mask)
    sq_dev = masked_sum((x - mean) ** 2, mask)
    if unbiased:
        return torch.where(count > 1, sq_dev / (count - 1).clamp_min(1), torch.zeros_like(sq_dev))
    return sq_dev / count.clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + EPS) over the masked elements; masked-out positions come back 0."""
    x = zero_outside(x, mask)
    return zero_outside((x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + EPS), mask)


def dense_group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids `[b]` to 0..G-1 (first-seen order not guaranteed); return (index [b], G)."""
    unique, index = torch.unique(group_ids, return_inverse=True)
    return index, unique.numel()


def group_mean_std(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row mean, unbiased std and size of the row's group, each `[b]` (std 0 for a group of one)."""
    index, num_groups = dense_group_index(group_ids)
    values = values.to(torch.float32)
    counts = torch.zeros(num_groups, device=values.device).index_add_(0, index, torch.ones_like(values))
    means = torch.zeros(num_groups, device=values.device).index_add_(0, index, values) / counts
    sq_dev = torch.zeros(num_groups, device=values.device).index_add_(0, index, (values - means[index]) ** 2)
    stds = torch.where(counts > 1, sq_dev / (counts - 1).clamp_min(1), torch.zeros_like(sq_dev)).sqrt()
    return means[index], stds[index], counts[index]
