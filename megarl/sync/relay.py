"""Colocated sync where one handle cannot reach every engine rank: copies of a bucket where it can.

A CUDA IPC handle opens only on the GPU it names (peer access between GPUs is not a given), named
shared memory only on its node. So each engine rank gets a handle to memory at its own memory site
(`engines.replicas.placement.memory_site`). For a bucket, an engine rank's *holder* is the bucket's owner
when the owner sits at the engine rank's site, else the lowest trainer rank there.

Per bucket, in the schedule's order, on the main thread of every rank:
- the owner sends the packed bucket to each other holder (point to point) and receives, from each,
  the entries it serialized of its copy (one per engine rank it serves); the owner's transport then
  posts one update per replica with every rank's entry;
- a holder receives the bucket into a buffer of its own, sends its entries back, posts a receive for
  the owner's ack (sent by the owner's event loop once the engines answered) and keeps the buffer until
  that ack arrives. It keeps at most two; the third waits for the oldest ack, and `drain` for the rest
  at the end of the stream. The receive is posted at once so that an ack never waits for a holder
  that is itself waiting for the owner's next bucket.
Buckets travel over the role's default backend (NCCL between GPUs, gloo on CPU), entries and acks
over gloo groups of their own, so the owner's event loop can ack while its main thread sends.
"""

import collections
import datetime
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from megarl.sync.plan import Bucket
from megarl.sync.transport import EngineTarget, HeldEntries

Entry = Callable[[torch.Tensor, list[tuple[str, torch.Tensor]]], str]
"""(bucket buffer, its named views) → one engine rank's serialized entry."""
KEPT = 2
"""Copies a holder keeps while their engines read them."""


def holders(owner: int, rank_sites: Sequence[str], targets: Sequence[EngineTarget]) -> list[list[int]]:
    """`holders(...)[t][i]`: the trainer rank whose memory engine rank i of target t maps for `owner`'s buckets."""
    out = []
    for target in targets:
        if not target.sites or not rank_sites:
            out.append([owner] * target.ranks)
            continue
        if len(target.sites) != target.ranks:
            raise ValueError(
                f"engine {target.url}: {len(target.sites)} device sites for {target.ranks} TP ranks; colocated "
                "tensor sync needs one site per rank (rollout.pipeline_parallel_size=1)"
            )
        row = []
        for i, site in enumerate(target.sites):
            local = [r for r, s in enumerate(rank_sites) if s == site]
            if not local:
                raise ValueError(
                    f"engine {target.url} rank {i} runs at {site}, where no trainer rank runs: a colocated engine "
                    "needs a trainer rank on its device to hand it weights; use trainer.placement=separate"
                )
            row.append(owner if rank_sites[owner] == site else local[0])
        out.append(row)
    return out


def remote_holders(owner: int, rank_sites: Sequence[str], targets: Sequence[EngineTarget]) -> list[int]:
    """The ranks other than `owner` that hold copies of its buckets."""
    return sorted({h for row in holders(owner, rank_sites, targets) for h in row} - {owner})


class Relay:
    """Copies of owners' buckets on holders. Construct on every rank of the role (it creates groups)."""

    def __init__(
        self, rank_sites: Sequence[str], targets: Sequence[EngineTarget], entry: Entry, timeout_s: float
    ) -> None:
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        self._remote = [remote_holders(owner, rank_sites, targets) for owner in range(world)]
        """Per owner: the other ranks holding copies of its buckets (the same on every rank)."""
        tables = [holders(owner, rank_sites, targets) for owner in range(world)]
        self._served = [
            [(t, i) for t, row in enumerate(table) for i, h in enumerate(row) if h == self.rank] for table in tables
        ]
        """Per owner: the (target, engine rank) pairs this rank serves for its buckets."""
        self._entry = entry
        timeout = datetime.timedelta(seconds=timeout_s)
        self._data = dist.new_group(timeout=timeout)
        self._entries = dist.new_group(backend="gloo", timeout=timeout)
        self._acks = dist.new_group(backend="gloo", timeout=timeout)
        self._kept: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()

    def distribute(self, flat: torch.Tensor) -> HeldEntries:
        """As the owner: send `flat` to every other holder; returns the entries they made of their copies."""
        held: HeldEntries = {}
        others = self._remote[self.rank]
        for holder in others:
            dist.send(flat, holder, group=self._data)
        for holder in others:
            box: list[object] = [None]
            dist.recv_object_list(box, holder, group=self._entries)
            held.update(cast(HeldEntries, box[0]))
        return held

    def hold(self, bucket: Bucket, allocate: Callable[[Bucket], torch.Tensor]) -> None:
        """As a possible holder of `bucket` (not its owner): receive a copy into `allocate(bucket)` (a
        buffer of the bucket's size in its dtype) and answer with its entries."""
        served = self._served[bucket.owner]
        if not served:
            return
        if len(self._kept) == KEPT:
            self._release_oldest()
        copy = allocate(bucket)
        dist.recv(copy, bucket.owner, group=self._data)
        if copy.is_cuda:
            torch.cuda.current_stream(copy.device).synchronize()  # the engine reads on its own stream
        named = bucket.views(copy)
        entries = {pair: self._entry(copy, named) for pair in served}
        dist.send_object_list([entries], bucket.owner, group=self._entries)
        ack = dist.irecv(torch.zeros(1, dtype=torch.int32), bucket.owner, group=self._acks)
        assert ack is not None  # this rank is in the group
        self._kept.append((ack, copy))

    def acknowledge(self) -> None:
        """As the owner, once the engines answered for a bucket: let its holders free their copies."""
        for holder in self._remote[self.rank]:
            dist.send(torch.zeros(1, dtype=torch.int32), holder, group=self._acks)

    def drain(self) -> None:
        """Wait for the acks of every copy still kept (the end of a stream)."""
        while self._kept:
            self._release_oldest()

    def _release_oldest(self) -> None:
        ack, _ = self._kept.popleft()
        ack.wait()


def needs_relay(world: int, rank_sites: Sequence[str], targets: Sequence[EngineTarget]) -> bool:
    """Whether some rank's buckets need copies elsewhere (the same answer on every rank)."""
    return any(remote_holders(owner, rank_sites, targets) for owner in range(world))
