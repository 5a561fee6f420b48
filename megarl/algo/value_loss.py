"""Clipped value loss of the critic.

V_clip = V_old + clip(V − V_old, ±cliprange_value);  ℓ_t = ½·max((V − R)², (V_clip − R)²),
aggregated by `algorithm.loss_agg_mode` like the policy loss. `critic.cliprange_value` sets the
range; `inf` disables clipping.
"""

import torch
from torch import Tensor

from megarl.algo.aggregation import LossNormalizer, aggregate_loss
from megarl.algo.stats import masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, metrics: vf_clipfrac = fraction of tokens where the clipped error was larger, vpred_mean)."""
    values = values.float()
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped - returns).square()
    loss_mat = 0.5 * torch.maximum(unclipped_error, clipped_error)
    mask = response_mask.to(torch.float32)
    metrics = {
        "vf_clipfrac": masked_mean((clipped_error > unclipped_error).float(), mask),
        "vpred_mean": masked_mean(values.detach(), mask),
    }
    return aggregate_loss(loss_mat, response_mask, loss_agg_mode, normalizer), metrics
