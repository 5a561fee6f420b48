"""The broadcast group between trainer senders and engine ranks (separate pools).

Mirrors SGLang's `init_custom_process_group` (srt/utils/common.py): a standalone process group,
not the default one, whose store keys are prefixed with the group name; the trainer joins as rank
0 and is the broadcast source; engine rank = rank_offset + its TP rank. gloo on CPU, NCCL on GPU.
"""

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

from megarl.engines.protocol import DEFAULT_GROUP_NAME


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> Any:
    """Join (rank 0: create) the group; blocks until all `world_size` ranks joined or `timeout_s`.

    Returns the gloo or NCCL backend object itself (torch's stubs do not type its collectives).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight update group backend={backend!r}: use gloo or nccl")


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from rank 0 of `group`."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def flat_offsets(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of tensors packed in one uint8 buffer, each aligned to its itemsize; and the total size.

    The layout of SGLang's `flattened_bucket` load format (srt/weight_sync/tensor_bucket.py).
    """
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = torch.empty((), dtype=dtype).element_size()
        start = -(-end // size) * size
        offsets.append(start)
        end = start + nbytes(dtype, shape)
    return offsets, end


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape`."""
    return torch.empty((), dtype=dtype).element_size() * math.prod(shape)
