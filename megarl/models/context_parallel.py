"""Context parallelism over a pack: which of its tokens each CP rank holds, and moving tensors between the layouts.

A pack (`megarl.megatron.packing`) holds sequences each padded to a multiple of 2·CP tokens. Each sequence is cut
into 2·CP equal chunks and CP rank i holds chunks i and 2·CP−1−i, in that order, sequence after sequence:
megatron's load balancing for causal attention (every rank gets one early and one late chunk), the layout
megatron-core's THD rotary embedding reads (rope_utils.py `_get_thd_freqs_on_this_cp_rank`) and
TransformerEngine's context-parallel attention expects. A rank's local pack is `1/CP` of the full one.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def local_positions(cu_seqlens_padded: Tensor, cp: int, rank: int) -> Tensor:
    """The full-pack positions CP rank `rank` holds, in its local order ([t / cp])."""
    bounds = cu_seqlens_padded.long()
    lengths = bounds[1:] - bounds[:-1]
    if bool((lengths % (2 * cp)).any()):
        raise ValueError(f"every packed sequence must be a multiple of 2·CP = {2 * cp} tokens, got {lengths.tolist()}")
    chunk = lengths // (2 * cp)  # [b]
    starts = bounds[:-1]
    offsets = torch.arange(int(chunk.max()), device=bounds.device)
    pieces = []
    for part in (rank, 2 * cp - 1 - rank):
        first = starts + part * chunk  # [b]
        pieces.append(first.unsqueeze(1) + offsets.unsqueeze(0))  # [b, longest chunk]
    grid = torch.stack(pieces, dim=1).flatten(1)  # [b, 2·longest chunk]: this rank's chunks of each row in order
    keep = (offsets.unsqueeze(0) < chunk.unsqueeze(1)).repeat(1, 2)
    return grid[keep]


class _AllGather(torch.autograd.Function):
    """Forward: every rank's `[n, ...]` stacked `[cp·n, ...]`. Backward: the gradients all ranks computed for this
    rank's part, summed (an all-reduce: gloo has no reduce-scatter; torch.distributed.nn's `all_gather` fails its
    backward on a subgroup here, distributed_c10d `get_group_rank`)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.group.size())[ctx.group.rank()], None


def gather_pack(local: Tensor, cu_seqlens_padded: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The full pack `[t, ...]` from every CP rank's local one `[t / cp, ...]`; gradients go back to their rank."""
    cp = group.size()
    order = torch.cat([local_positions(cu_seqlens_padded, cp, rank) for rank in range(cp)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    gathered: Tensor = _AllGather.apply(local, group)
    return gathered[inverse]


class _SumOfParts(torch.autograd.Function):
    """Forward: the sum of every CP rank's part. Backward: the gradient unchanged, to this rank's part.

    Every CP rank computes the same loss from the same combined tensor, and each part depends only on its own
    rank's tokens: a rank's part gets the loss's gradient once, and megatron's gradient reduction over the
    data- and context-parallel group adds the ranks' contributions (an autograd all-reduce would add the same
    gradient CP times)."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def sum_of_parts(part: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every CP rank's `part` (zero where another rank owns the entry) summed, gradient flowing to the owner."""
    result: Tensor = _SumOfParts.apply(part, group)
    return result
