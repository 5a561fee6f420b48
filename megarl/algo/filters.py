"""Sampling filters and reward shaping of DAPO.

- Dynamic sampling (`algorithm.filter_groups`): a prompt whose n samples all score the same
  teaches nothing to a group-relative estimator (every advantage is 0), so its group is dropped
  and the trainer generates more prompts until the batch is full. A group of one sample is kept
  (nothing to compare it with; the estimator decides what it learns).
- Over-long shaping (`algorithm.overlong_buffer`): with L_max = data.max_response_length and a
  buffer of B tokens, a response of length ℓ > L_max − B is penalised linearly,
  p = −min(ℓ − (L_max − B), B) / B · penalty_factor (0 ≥ p ≥ −penalty_factor), added to its score.
"""

from dataclasses import dataclass

from torch import Tensor

from megarl.algo.stats import group_mean_std


@dataclass(frozen=True, slots=True)
class GroupFilterResult:
    keep: Tensor
    """[b] bool: the sample's group is kept."""
    num_groups: int
    num_kept_groups: int


def filter_uniform_groups(group_ids: Tensor, metric: Tensor) -> GroupFilterResult:
    """Keep the samples of groups whose `metric` `[b]` is not the same for all members (or with one member)."""
    _, std, count = group_mean_std(metric, group_ids)
    keep = (std > 0) | (count == 1)
    return GroupFilterResult(
        keep=keep, num_groups=group_ids.unique().numel(), num_kept_groups=group_ids[keep].unique().numel()
    )


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> Tensor:
    """[b] penalty (≤ 0) for responses longer than max_response_length − buffer_length (formula above)."""
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"algorithm.overlong_buffer.len={buffer_length} must be in [1, data.max_response_length="
            f"{max_response_length}]"
        )
    excess = (response_lengths.float() - (max_response_length - buffer_length)).clamp(0, buffer_length)
    return -excess / buffer_length * penalty_factor
