"""Transforms: a parameter's (expert-)TP shards → its HF tensors, as views (no copies).

`gather_shards` brings the shards to the owner as one `[size, *shard]` tensor (peers send and get
nothing back). `hf_views` reads the HF tensors out of it: un-fusing QKV and gate/up, undoing the TP
split and the vocabulary padding. Each view's row-major order is its HF tensor's, so the executor
copies it straight into its bucket slot (casting to the bucket's dtype on the way) and no
intermediate tensor is made.

`rank_parts` is the same layout seen from one rank: where its shard's rows fall in each HF tensor.
With it every rank of the group writes its own shard into the bucket (`write_shard`, `sync.peers`)
and nothing is gathered.
"""

import torch
import torch.distributed as dist

from megarl.models.param_mapping import ParamMapping


def needs_gather(mapping: ParamMapping, group_size: int) -> bool:
    return mapping.tp_dim is not None and group_size > 1


def gather_shards(
    param: torch.Tensor, mapping: ParamMapping, group: dist.ProcessGroup, group_size: int, owner: int
) -> torch.Tensor | None:
    """On the owner: `[size, *shard]` in group-rank order; on a peer: None (it sent its shard).

    Point-to-point, so each shard lands directly in its row (a gather would stage a second copy).
    """
    shard = param.detach()
    if not needs_gather(mapping, group_size):
        return shard.unsqueeze(0)
    if dist.get_rank() != owner:
        dist.send(shard.contiguous(), dst=owner, group=group)
        return None
    out = torch.empty((group_size, *shard.shape), dtype=shard.dtype, device=shard.device)
    for row, rank in enumerate(dist.get_process_group_ranks(group)):
        if rank == owner:
            out[row].copy_(shard)
        else:
            dist.recv(out[row], src=rank, group=group)
    return out


def _check(mapping: ParamMapping, shard_dims: int, size: int) -> None:
    if mapping.tp_dim == 1 and size > 1 and (mapping.fuse != "none" or shard_dims != 2):
        raise ValueError(f"{mapping.mcore_name}: no transform for a fused or >2-d tensor split on dim 1")
    if mapping.tp_dim not in (None, 0, 1):
        raise ValueError(f"{mapping.mcore_name}: no transform for tp_dim={mapping.tp_dim}")


def hf_views(mapping: ParamMapping, gathered: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors of `mapping.hf_names`, each a view whose flattening is that HF tensor."""
    size = gathered.shape[0]
    rest = gathered.shape[2:]
    _check(mapping, gathered.dim() - 1, size)
    if mapping.tp_dim == 1 and size > 1:
        return [gathered.transpose(0, 1)]  # [rows, size, cols/size]: row r is the ranks' row r side by side
    if mapping.fuse == "gate_up":
        halves = gathered.view(size, 2, gathered.shape[1] // 2, *rest)  # each rank holds [gate_r; up_r]
        return [halves[:, 0], halves[:, 1]]
    full = gathered.view(size * gathered.shape[1], *rest)
    if mapping.fuse == "qkv":
        assert mapping.qkv_groups is not None
        num_groups, heads_per_group, head_dim = mapping.qkv_groups
        grouped = full.view(num_groups, (heads_per_group + 2) * head_dim, *full.shape[1:])
        return list(grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1))
    return mapping.split(full)


def rank_parts(
    mapping: ParamMapping, shard: torch.Tensor, slots: list[torch.Tensor], size: int, rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(slot part, shard part) pairs: where row `rank` of the gathered tensor lands in each HF tensor.

    `slots` are the HF tensors of `mapping` (e.g. a bucket's slots, shaped as `hf_shapes`) and `shard`
    is TP rank `rank`'s of `size`; both parts are views. Copying every rank's pairs fills the slots as
    copying `hf_views(gathered)` into them would (tests/unit/sync/test_sync_plan.py checks each mapping kind).
    """
    _check(mapping, shard.dim(), size)
    rest = shard.shape[1:]
    if mapping.tp_dim == 1:  # [rows, size * cols]: the rank's columns of every row
        (slot,) = slots
        return [(slot.view(slot.shape[0], size, -1)[:, rank], shard)]
    if mapping.fuse == "gate_up":  # the shard is [gate_r; up_r], rank r's rows of each
        halves = shard.view(2, shard.shape[0] // 2, *rest)
        return [(slot.view(size, -1, *rest)[rank], half) for slot, half in zip(slots, halves, strict=True)]
    if mapping.fuse == "qkv":  # the shard holds whole query groups, each [q; k; v]
        assert mapping.qkv_groups is not None
        num_groups, heads_per_group, head_dim = mapping.qkv_groups
        local = num_groups // size
        parts = shard.view(local, -1, *rest).split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
        mine = slice(rank * local, (rank + 1) * local)
        return [(slot.view(num_groups, -1, *rest)[mine], part) for slot, part in zip(slots, parts, strict=True)]
    (slot,) = slots  # rows split in rank order; rows past the true vocabulary (padding) are dropped
    rows = shard.shape[0]
    start = min(rank * rows, slot.shape[0])
    stop = min(start + rows, slot.shape[0])
    return [(slot[start:stop], shard[: stop - start])]


@torch.no_grad()
def write_shard(
    param: torch.Tensor, mapping: ParamMapping, group: dist.ProcessGroup, slots: list[torch.Tensor]
) -> None:
    """Copy this rank's shard of a TP-split parameter into its places in `slots` (casting to their dtype)."""
    ranks = dist.get_process_group_ranks(group)
    for dest, src in rank_parts(mapping, param.detach(), slots, len(ranks), ranks.index(dist.get_rank())):
        assert dest.shape == src.shape, (mapping.mcore_name, dest.shape, src.shape)
        dest.copy_(src)
