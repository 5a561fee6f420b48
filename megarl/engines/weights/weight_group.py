"""The weight-update group between a trainer sender and engine ranks (separate pools).

Built the way SGLang 0.5.23 builds its side (`srt/utils/common.py::init_custom_process_group`,
called by `model_runner_components/weight_updater.py::init_weights_update_group`): a TCP
rendezvous at master_address:master_port hosted by rank 0, the store wrapped in
`PrefixStore(group_name)`, then torch's own `_new_process_group_helper`, which prefixes the keys
again with "{group_name}/" and "{device}/". A group built any other way (e.g. `ProcessGroupGloo` on
one `PrefixStore`) waits on other store keys and never meets the engine.

The trainer joins as rank 0 and is the broadcast source; engine rank = rank_offset + its TP rank.
gloo on CPU; NCCL on GPUs, every rank on its own device. The helper also registers the group in
torch's process-group table, so `close_weight_group` must run before a group of the same name is
built again in the process. Tested against SGLang's own function in tests/dist/test_sglang_contract.py.
"""

import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megarl.engines.client.sglang_api import DEFAULT_GROUP_NAME

BACKENDS = ("gloo", "nccl")


def tcp_init_method(host: str, port: int) -> str:
    """`tcp://host:port`, IPv6 hosts in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` ranks joined or `timeout_s`."""
    if backend not in BACKENDS:
        raise ValueError(f"weight update group backend={backend!r}: use one of {BACKENDS}")
    timeout = datetime.timedelta(seconds=timeout_s)
    rendezvous = c10d.rendezvous(tcp_init_method(master_address, master_port), rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous)
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def close_weight_group(group: dist.ProcessGroup) -> None:
    """Leave `group` and drop it from torch's table (its name is free again)."""
    dist.destroy_process_group(group)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from rank 0 of `group`."""
    dist.broadcast(tensor, group=group, group_src=0)


def flat_offsets(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of tensors packed back to back in one uint8 buffer, and its size.

    SGLang's `flattened_bucket` layout for `update_weights_from_distributed`
    (`srt/weight_sync/tensor_bucket.py::FlattenedTensorBucket.empty`): no padding, and a tensor whose
    offset is not a multiple of its itemsize is refused (ValueError), so senders keep buckets
    single-dtype or ordered by falling itemsize.
    """
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = dtype.itemsize
        if end % size:
            raise ValueError(f"a {dtype} tensor would start at byte {end}, not a multiple of its itemsize {size}")
        offsets.append(end)
        end += nbytes(dtype, shape)
    return offsets, end


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape`."""
    return dtype.itemsize * math.prod(shape)
