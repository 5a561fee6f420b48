"""Transforms: a parameter's (expert-)TP shards → its HF tensors, as views (no copies).

`gather_shards` brings the shards to the owner as one `[size, *shard]` tensor (peers send and get
nothing back). `hf_views` reads the HF tensors out of it: un-fusing QKV and gate/up, undoing the TP
split and the vocabulary padding. Each view's row-major order is its HF tensor's, so the executor
copies it straight into its bucket slot (casting to the engine's dtype on the way) and no
intermediate tensor is made.
"""

import torch
import torch.distributed as dist

from megarl.models.weight_map import ParamMapping


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


def hf_views(mapping: ParamMapping, gathered: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors of `mapping.hf_names`, each a view whose flattening is that HF tensor."""
    size = gathered.shape[0]
    rest = gathered.shape[2:]
    if mapping.tp_dim == 1 and size > 1:
        if mapping.fuse != "none" or len(rest) != 1:
            raise ValueError(f"{mapping.mcore_name}: no transform for a fused or >2-d tensor split on dim 1")
        return [gathered.transpose(0, 1)]  # [rows, size, cols/size]: row r is the ranks' row r side by side
    if mapping.tp_dim not in (None, 0, 1):
        raise ValueError(f"{mapping.mcore_name}: no transform for tp_dim={mapping.tp_dim}")
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
