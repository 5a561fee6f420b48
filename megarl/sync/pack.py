"""Packing one bucket: its owner fills the buffer with the bucket's HF tensors in the bucket's dtype.

Each TP-split tensor's shards come from the ranks of its (expert-)TP group. Where the buffer is shared
memory they all see (`sync.peers`), every rank writes its own shard into it (`transforms.write_shard`);
otherwise the peers send their shards and the owner gathers them into one `[tp, *shard]` tensor whose
HF views it copies (`transforms.gather_shards`, `hf_views`). Whole tensors the owner copies itself.
"""

import torch

from megarl.sync.errors import SyncError
from megarl.sync.metrics import Accounting
from megarl.sync.peers import PeerWrites
from megarl.sync.plan import Bucket, LocalParam, LocalParams, PlannedTensor
from megarl.sync.transforms import gather_shards, hf_views, needs_gather, write_shard


def pack_bucket(
    bucket: Bucket,
    local: LocalParams,
    flat: torch.Tensor,
    kept: list[torch.Tensor],
    peers: PeerWrites,
    memory: Accounting,
) -> list[tuple[str, torch.Tensor]]:
    """As the owner: fill `flat` (a view of an `allocate`d buffer; `kept`: the buffers kept between syncs)
    with the bucket's HF tensors. Returns them by name, as views of `flat`."""
    writers = peers.writers(bucket, local)
    if writers:
        peers.start(writers, flat, kept)
    for tensor, slots in zip(bucket.tensors, bucket.tensor_slots(flat), strict=True):
        part = local[tensor.mcore_name]
        if peers.direct(part):
            write_shard(part.weight(), part.mapping, part.group, slots)
        else:
            _copy_gathered(bucket, tensor, part, slots, memory)
    peers.wait()
    return bucket.views(flat)


def send_shards(bucket: Bucket, local: LocalParams, peers: PeerWrites) -> None:
    """As a peer: this rank's shard of each tensor of `bucket` it holds a part of, in order: written into
    the owner's buffer or sent to the owner, which gathers."""
    slots = peers.receive(bucket, local)
    for i, tensor in enumerate(bucket.tensors):
        part = local.get(tensor.mcore_name)
        if part is None or not needs_gather(part.mapping, part.group_size):
            continue
        if slots is not None and peers.direct(part):
            write_shard(part.weight(), part.mapping, part.group, slots[i])
        else:
            gather_shards(part.weight(), part.mapping, part.group, part.group_size, part.owner_in_group)
    if slots is not None:
        peers.done(bucket.owner)


@torch.no_grad()
def _copy_gathered(
    bucket: Bucket, tensor: PlannedTensor, part: LocalParam, slots: list[torch.Tensor], memory: Accounting
) -> None:
    """Gather the tensor's shards here (a no-op for a whole tensor) and copy its HF views into `slots`."""
    gathered = gather_shards(part.weight(), part.mapping, part.group, part.group_size, part.owner_in_group)
    assert gathered is not None  # this rank owns the tensor
    extra = gathered.numel() * gathered.element_size() if needs_gather(part.mapping, part.group_size) else 0
    memory.add(extra)
    for name, slot, view in zip(tensor.hf_names, slots, hf_views(part.mapping, gathered), strict=True):
        if view.numel() != slot.numel():
            raise SyncError(f"{bucket.describe()}: {name} has {view.numel()} elements, the plan {tuple(slot.shape)}")
        slot.view(view.shape).copy_(view)
    memory.sub(extra)
