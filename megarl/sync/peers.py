"""Peer writes: TP peers write their shards straight into the owner's shared-memory bucket.

On CPU the tensor transport's buckets are named shared memory (`TensorTransport.allocate`). The gather
(`transforms.gather_shards`) would send each peer's shard over gloo, through the kernel on loopback,
into a `[tp, *shard]` tensor that the owner then copies into the bucket: at TP=2 on 2 cores that was
3/4 of a sync (docs/sync.md). Instead, per bucket:
- the owner tells each peer which of its buffers to write (`Go`, with the buffer's handle the first time
  that peer needs it: torch's file_system sharing, as the engine gets it), then writes its own shards;
- each peer maps the buffer, writes its shard of each tensor where its rows fall
  (`transforms.write_shard`) and answers;
- the owner hands the bucket to the transport once every peer answered.
So every byte is copied once, by the rank that holds it, and ranks write in parallel. Peers keep the
owner's kept buffers mapped between syncs (no new page-table entries each time) and drop a mapping as
soon as the owner no longer lists the buffer as kept.

A tensor goes this way when every rank of its (expert-)TP group sees the owner's shared memory (one
machine, one /dev/shm); otherwise, and for CUDA buckets, by the gather (`Transport.peers_can_write`).
Messages travel on a gloo group of their own, from the main thread only.
"""

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from megarl.engines.weights.tensor_handles import deserialize_named_tensors, serialize_named_tensors
from megarl.sync.plan import Bucket, LocalParam, LocalParams
from megarl.sync.transforms import needs_gather

T = TypeVar("T")


def memory_site() -> str:
    """Which named shared memory this process sees: torch's file_system strategy creates it with
    `shm_open`, i.e. in /dev/shm, so the boot and that mount's device identify it."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/dev/shm').st_dev}"


def buffer_name(buffer: torch.Tensor) -> str:
    """The name of the shared-memory segment `TensorTransport.allocate` made (torch/csrc/StorageSharing.cpp)."""
    _, name, _ = buffer.untyped_storage()._share_filename_cpu_()
    return name.decode()


@dataclass(frozen=True, slots=True)
class Go:
    """Owner → peer, once per bucket: write into the owner's buffer `slot`."""

    slot: int
    """Index among the owner's kept buffers; -1: a one-off buffer, unmapped once written."""
    kept: int
    """How many buffers the owner keeps: the peer unmaps any slot past them once written."""
    handle: str = ""
    """The buffer's handle, when the peer has not mapped it yet."""

    def tensors(self) -> list[torch.Tensor]:
        header = torch.tensor([self.slot, self.kept, len(self.handle)], dtype=torch.int64)
        if not self.handle:
            return [header]
        return [header, torch.frombuffer(bytearray(self.handle.encode("ascii")), dtype=torch.uint8)]


def _still_mapped(mapped: dict[int, T], go: Go) -> dict[int, T]:
    """What a peer keeps mapped after writing for `go` (the owner tracks it by the same rule)."""
    return {slot: value for slot, value in mapped.items() if 0 <= slot < go.kept}


class PeerWrites:
    """Construct on every rank of the role (it creates a group when `enabled`).

    The owner sends without waiting (`isend`) and posts the receive of each answer at once (`irecv`), so it
    writes its own shards straight away and an answer needs no further hand-shake; `wait` collects them.
    """

    def __init__(self, enabled: bool, timeout_s: float) -> None:
        """`enabled`: the buckets are memory peers can write (`Transport.peers_can_write`; the same on every rank)."""
        self.enabled = enabled
        self.rank = dist.get_rank()
        self._sites: list[object] = []
        if enabled:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            self._sites = [None] * dist.get_world_size()
            dist.all_gather_object(self._sites, memory_site(), group=self._group)
        self._mapped: dict[int, dict[int, str]] = {}
        """As an owner: per peer, the name of my buffer it has mapped in each slot."""
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        """As an owner: messages in flight both ways, with their tensors."""
        self._buffers: dict[int, dict[int, torch.Tensor]] = {}
        """As a peer: per owner, its buffers mapped here by slot."""
        self._go: Go | None = None
        """As a peer: the owner's message for the bucket being written."""

    def direct(self, part: LocalParam) -> bool:
        """Whether this tensor's shards are written in place, each by the rank of its group holding it."""
        if not self.enabled or not needs_gather(part.mapping, part.group_size):
            return False
        owner_site = self._sites[part.owner_in_group]
        return all(self._sites[r] == owner_site for r in dist.get_process_group_ranks(part.group))

    def writers(self, bucket: Bucket, local: LocalParams) -> list[int]:
        """The ranks other than the owner that write into `bucket`. Whether a rank is one of them is the
        same on the owner and on that rank (its `local` has every tensor of a group it is in)."""
        parts = [local[t.mcore_name] for t in bucket.tensors if t.mcore_name in local]
        ranks = {r for p in parts if self.direct(p) for r in dist.get_process_group_ranks(p.group)}
        return sorted(ranks - {bucket.owner})

    def start(self, peers: list[int], flat: torch.Tensor, kept: list[torch.Tensor]) -> None:
        """As the owner: let `peers` write into `flat` (a view of an `allocate`d buffer); `kept`: my kept buffers."""
        slot = next((i for i, b in enumerate(kept) if b.data_ptr() == flat.data_ptr()), -1)
        buffer = kept[slot] if slot >= 0 else flat
        name = buffer_name(buffer)
        for peer in peers:
            mapped = self._mapped.get(peer, {})
            handle = "" if mapped.get(slot) == name else serialize_named_tensors([(name, buffer)])
            go = Go(slot, len(kept), handle)
            for tensor in go.tensors():
                self._post(dist.isend, tensor, peer)
            self._mapped[peer] = _still_mapped({**mapped, slot: name}, go)
            self._post(dist.irecv, torch.zeros(1, dtype=torch.int32), peer)  # posted now: the answer lands at once

    def _post(self, op: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int) -> None:
        work = op(tensor, peer, group=self._group)
        assert work is not None  # this rank is in the group
        self._pending.append((work, tensor))

    def wait(self) -> None:
        """As the owner: until every peer `start` named wrote its shards."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def receive(self, bucket: Bucket, local: LocalParams) -> list[list[torch.Tensor]] | None:
        """As a peer: each tensor's slots in the owner's buffer for `bucket` (mapped here); None when this
        rank writes nothing into it."""
        if self.rank not in self.writers(bucket, local):
            return None
        header = torch.zeros(3, dtype=torch.int64)
        dist.recv(header, bucket.owner, group=self._group)
        slot, kept, length = header.tolist()
        buffers = self._buffers.setdefault(bucket.owner, {})
        if length:
            payload = torch.zeros(length, dtype=torch.uint8)
            dist.recv(payload, bucket.owner, group=self._group)
            ((_, buffers[slot]),) = deserialize_named_tensors(bytes(payload.numpy()).decode("ascii"))
        self._go = Go(slot, kept)
        buffer = buffers[slot]
        return bucket.tensor_slots(bucket.typed(buffer))

    def done(self, owner: int) -> None:
        """As a peer: my shards are in the owner's buffer; unmap what it no longer keeps."""
        assert self._go is not None
        self._buffers[owner] = _still_mapped(self._buffers[owner], self._go)
        self._go = None
        dist.send(torch.ones(1, dtype=torch.int32), owner, group=self._group)

    def release(self) -> None:
        """Forget every mapping (every rank, as the owners drop their buffers)."""
        self._mapped = {}
        self._buffers = {}
