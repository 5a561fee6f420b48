"""The executor: one weight sync from the trainer ranks into every replica, bucket by bucket.

Every rank of the role calls `WeightSyncer.sync()`. Ranks walk the plan's global bucket schedule
in the same order: a bucket's owner fills one flat buffer with the HF tensors in the bucket's dtype
(the engine's, or fp32 for the tensors HF keeps in fp32, `sync.plan`; `sync.pack`: its (expert-)TP
peers write their shards straight into it when it is shared memory on their machine, else send them
for the owner to gather) and hands it to the transport on its event-loop thread; with two buffers
(`Transport.buffers`) it packs its next bucket while that one is in flight. Owners of different
pipeline stages and EP ranks therefore pack in parallel. Transfers of a collective transport are
handed from owner to owner in schedule order over a gloo token, so every engine rank sees one
broadcast at a time.

Rank 0 opens and closes the engines' weight-update session around the transfers, flushes their
caches and sets the weight version. Each rank's extra memory is at most two buckets + one gathered tensor.
"""

import asyncio
import concurrent.futures
import datetime
import time
from collections.abc import Awaitable, Callable

import torch
import torch.distributed as dist

from megarl.engines.client.fleet import Fleet
from megarl.engines.client.loop_thread import LoopThread
from megarl.megatron.model import BuiltModel
from megarl.megatron.parallel import RoleGroups
from megarl.sync.delta import DeltaTracker
from megarl.sync.errors import SyncError
from megarl.sync.metrics import Accounting, SyncMetrics
from megarl.sync.pack import pack_bucket, send_shards
from megarl.sync.peers import PeerWrites
from megarl.sync.plan import Bucket, LocalParams, SyncPlan, plan_sync
from megarl.sync.relay import Relay
from megarl.sync.transforms import hf_views, needs_gather
from megarl.sync.transport import EngineTarget, HeldEntries, Transport


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WeightSyncer:
    """Streams a policy's weights into engine replicas. Construct and call on every rank of the role."""

    def __init__(
        self,
        model: BuiltModel,
        groups: RoleGroups,
        targets: list[EngineTarget],
        transport: Transport,
        engines: Fleet,
        *,
        engine_dtype: torch.dtype,
        bucket_bytes: int,
        delta: bool = False,
        timeout_s: float = 600.0,
        relay: Relay | None = None,
        merge_lora: bool = False,
    ) -> None:
        self.model = model
        self.merge_lora = merge_lora
        """LoRA `merged` sync: layers with adapters are sent as W + scale·B·A (`LocalParam.weight`)."""
        self.groups = groups
        self.targets = targets
        self.transport = transport
        self.engine_dtype = engine_dtype
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.timeout_s = timeout_s
        self.engines = engines
        """Every replica's client, driven from rank 0 on this syncer's event loop (the transport's too)."""
        self.relay = relay
        """Copies of buckets on other trainer ranks, for engine ranks the owner's handles cannot reach."""
        self._rank = dist.get_rank()
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        device = next(model.chunks[0].parameters()).device
        self.peers = PeerWrites(transport.peers_can_write(device), timeout_s)
        """TP peers writing their shards into the owner's buckets, where they can."""
        self._loop = LoopThread("megarl-sync")
        self._tracker = DeltaTracker()
        self._plan: tuple[SyncPlan, LocalParams] | None = None
        self._plan_key: tuple | None = None
        self._opened = False
        self._rejoin = False
        """Whether the next sync leaves the weight-update groups and joins them again (`rejoin`)."""
        self._kept: list[torch.Tensor] = []

    # ---- plan ----

    def _layout_key(self) -> tuple:
        shapes = tuple((n, tuple(p.shape)) for c in self.model.chunks for n, p in c.named_parameters())
        return (self.groups.layout, self.bucket_bytes, self.engine_dtype, shapes)

    def plan(self) -> tuple[SyncPlan, LocalParams]:
        """The cached plan; recomputed (collectively) when any rank's layout or parameters changed."""
        key = self._layout_key()
        stale = torch.tensor([int(key != self._plan_key)])
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=self._control)
        if self._plan is None or stale.item():
            if self._opened:  # the owners may change: every old owner leaves, the new ones join
                self._close_transport()
                self._opened = False
            self._plan = plan_sync(self.model, self.groups, self.engine_dtype, self.bucket_bytes, self.merge_lora)
            self._plan_key = key
            self._tracker.forget()
        return self._plan

    # ---- one sync ----

    def sync(self, weight_version: str | None = None, full: bool = False) -> SyncMetrics:
        """Send the current weights (only changed ones with delta, unless `full`); returns global metrics."""
        start = time.perf_counter()
        begun = self._start_engines(Fleet.begin_update)  # in flight while the ranks agree on the plan
        plan, local = self.plan()
        if self._rejoin and self._opened:
            self._close_transport()
            self._opened = False
        self._rejoin = False
        device = next(iter(local.values())).param.device if local else torch.device("cpu")
        if full:
            self._tracker.forget()
        include = self._tracker.changed(plan, local, self._control) if self.delta else None
        buckets = plan.buckets(include)
        memory = Accounting()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self._await_engines("begin_weight_update", begun)
        self._open_transports(plan)
        self._stream(buckets, local, device, memory)
        peak = memory.peak
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        peak = self._max_over_ranks(peak, after="the last bucket")  # also the barrier before finishing
        finish = "end_weight_update, flush_cache, update_weight_version"
        self.call_engines(finish, lambda engines: engines.finish_update(weight_version))
        if self.delta:
            self._tracker.commit()
        sent = sum(b.nbytes for b in buckets)
        tensors = sum(len(b.tensors) for b in buckets)
        return SyncMetrics(
            bytes=sent,
            buckets=len(buckets),
            tensors=tensors,
            bytes_skipped=plan.total_bytes - sent,
            tensors_skipped=len(plan.tensors) - tensors,
            seconds=time.perf_counter() - start,
            peak_extra_bytes=peak,
        )

    def transport_floor(self) -> float:
        """Seconds to push the same buckets through the same transport with no gather, transform or
        overlap: each bucket is one copy from a pre-filled buffer, then the send. The yardstick of
        `sync()`'s speed (bench/sync.py). Collective; the engines receive garbage and need a sync after."""
        if self.relay is not None:
            raise SyncError("transport_floor measures one sender's handles; this layout relays copies (sync.relay)")
        plan, _ = self.plan()
        buckets = plan.buckets()
        mine = [b for b in buckets if b.owner == self._rank]
        device = next(self.model.chunks[0].parameters()).device
        size = max((b.nbytes for b in mine), default=0)
        source = torch.ones(size, dtype=torch.uint8, device=device)
        if self._kept and self._kept[0].numel() == size:
            flat = self._kept[0]  # warm, as sync()'s
        else:
            flat = self.transport.allocate(size, torch.uint8, device) if mine else source
        self.call_engines("begin_weight_update", Fleet.begin_update)
        self._open_transports(plan)
        start = time.perf_counter()
        for bucket in mine:
            used = bucket.typed(flat)
            used.view(torch.uint8).copy_(source[: bucket.nbytes])
            self._loop.run(self._transfer(bucket, buckets, used, bucket.views(used)))
        self._barrier("the floor's last bucket")
        seconds = time.perf_counter() - start
        self.call_engines("end_weight_update", Fleet.end_update)
        return seconds

    def release_buffers(self) -> None:
        """Free the host buffers kept between syncs, and peers' mappings of them (every rank; the next sync
        allocates them again)."""
        self._kept = []
        self.peers.release()

    def rejoin(self) -> None:
        """The next sync rebuilds the transports first: a restarted engine is in no weight-update group (every rank)."""
        self._rejoin = True

    def close(self) -> None:
        """Leave the weight-update groups and stop the event loop (every rank)."""
        if self._opened:
            self._close_transport()
        self.peers.release()
        self._loop.run(self.engines.close())
        self._loop.stop()

    def _close_transport(self) -> None:
        if self._plan is not None and self._rank in self._plan[0].owners:
            self._loop.run(self.transport.close(), self.timeout_s)
        self._barrier("the owners closed their transports")

    # ---- steps ----

    def _barrier(self, after: str) -> None:
        try:
            dist.barrier(group=self._control)
        except RuntimeError as e:
            raise SyncError(f"weight sync: a rank did not arrive after {after} within {self.timeout_s} s: {e}") from e

    def _max_over_ranks(self, value: int, after: str) -> int:
        """The largest `value` of any rank, once every rank arrived (after `after`)."""
        reduced = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self._control)
        except RuntimeError as e:
            raise SyncError(f"weight sync: a rank did not arrive after {after} within {self.timeout_s} s: {e}") from e
        return int(reduced.item())

    def call_engines(self, step: str, call: Callable[[Fleet], Awaitable[object]]) -> None:
        """Rank 0 runs `call(self.engines)` (e.g. `Fleet.begin_update`); every rank returns once it finished."""
        self._await_engines(step, self._start_engines(call))

    def _start_engines(self, call: Callable[[Fleet], Awaitable[object]]) -> concurrent.futures.Future | None:
        """On rank 0: `call(self.engines)`, started on the event loop. None on the other ranks."""
        if self._rank != 0:
            return None

        async def run() -> None:
            await call(self.engines)

        return self._loop.submit(run())

    def _await_engines(self, step: str, started: concurrent.futures.Future | None) -> None:
        """Every rank returns once rank 0's `_start_engines` calls finished, or raises with it if they failed (the
        ranks stay in step for what their caller does next)."""
        error: Exception | None = None
        if started is not None:
            try:
                started.result(self.timeout_s)
            except Exception as e:
                error = e
        if self._max_over_ranks(int(error is not None), after=step):
            cause = f": {type(error).__name__}: {error}" if error is not None else " on rank 0"
            raise SyncError(f"weight sync step {step} failed{cause}") from error

    def _open_transports(self, plan: SyncPlan) -> None:
        """Owners join their engines one after another (an engine joins one group at a time)."""
        if self._opened:
            return
        for owner in plan.owners:
            if owner == self._rank:
                try:
                    self._loop.run(self.transport.open(), self.timeout_s)
                except Exception as e:
                    raise SyncError(f"rank {owner} could not reach the engines: {type(e).__name__}: {e}") from e
            self._barrier(f"rank {owner} opened its transport")
        self._opened = True

    def _stream(self, buckets: list[Bucket], local: LocalParams, device: torch.device, memory: Accounting) -> None:
        """Pack my buckets into the transport's rotating buffers (`Transport.buffers`): with two, each is
        sent while the next is packed; with one, packing waits for the transfer.

        The buffers are bytes (uint8), each bucket packed into the first of them in its own dtype
        (`Bucket.typed`). On CPU they are kept for the next sync. A tensor larger than `bucket_bytes` has
        a bucket of its own: it is sent in place when the transport can (one contiguous HF view
        already in the bucket's dtype), else through a buffer of its size, freed after its transfer.
        """

        def copy_buffer(bucket: Bucket) -> torch.Tensor:
            return bucket.typed(self.transport.allocate(bucket.nbytes, torch.uint8, device))

        mine = [b.nbytes for b in buckets if b.owner == self._rank and b.nbytes <= self.bucket_bytes]
        pool = self._pool(max(mine, default=0), min(self.transport.buffers(device), len(mine)), device)
        memory.add(sum(_bytes(b) for b in pool))
        in_flight: tuple[concurrent.futures.Future, torch.Tensor | None] | None = None
        packed = 0
        try:
            for bucket in buckets:
                if bucket.owner != self._rank:
                    send_shards(bucket, local, self.peers)
                    if self.relay is not None:
                        self.relay.hold(bucket, copy_buffer)
                    continue
                one_off = None
                named = self._in_place(bucket, local, device) if bucket.nbytes > self.bucket_bytes else None
                if named is not None:
                    flat = named[0][1].view(-1)
                else:
                    if bucket.nbytes > self.bucket_bytes:
                        flat = one_off = copy_buffer(bucket)
                        memory.add(_bytes(one_off))
                    else:
                        if len(pool) == 1:  # its last transfer ends before it is packed again
                            self._retire(in_flight, memory)
                            in_flight = None
                        flat = bucket.typed(pool[packed % len(pool)])  # another may be in flight
                        packed += 1
                    named = pack_bucket(bucket, local, flat, pool, self.peers, memory)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # the engine reads on its own stream
                held = self.relay.distribute(flat) if self.relay is not None else None
                self._retire(in_flight, memory)
                in_flight = (self._loop.submit(self._transfer(bucket, buckets, flat, named, held)), one_off)
            self._retire(in_flight, memory)
            if self.relay is not None:
                self.relay.drain()
        finally:
            for buffer in pool:
                memory.sub(_bytes(buffer))
            # Host buffers stay for the next sync (no new shared-memory pages for us or the engine); device
            # buffers are dropped here, and the colocated trainer's next offload hands their blocks back to the
            # device before the engine wakes its KV cache (`sync.sequence`, `free_cached_memory`).
            self._kept = pool if device.type == "cpu" else []

    def _pool(self, size: int, count: int, device: torch.device) -> list[torch.Tensor]:
        """`count` rotating bucket buffers of `size` bytes: the kept ones when they fit, else new ones."""
        if len(self._kept) >= count and all(b.numel() == size for b in self._kept):
            return self._kept
        return [self.transport.allocate(size, torch.uint8, device) for _ in range(count)]

    def _retire(
        self, in_flight: tuple[concurrent.futures.Future, torch.Tensor | None] | None, memory: Accounting
    ) -> None:
        """Wait for the transfer in flight; free its buffer if it was a one-off."""
        if in_flight is None:
            return
        future, one_off = in_flight
        future.result()
        if one_off is not None:
            memory.sub(_bytes(one_off))

    def _in_place(
        self, bucket: Bucket, local: LocalParams, device: torch.device
    ) -> list[tuple[str, torch.Tensor]] | None:
        """The bucket's one tensor as a view of the parameter itself, when no gather, cast or copy is needed."""
        (tensor,) = bucket.tensors
        part = local[tensor.mcore_name]
        if needs_gather(part.mapping, part.group_size) or not self.transport.sends_in_place(device):
            return None
        if part.delta is not None:  # merged LoRA: made per bucket, not a view of the parameter
            return None
        views = hf_views(part.mapping, part.param.detach().unsqueeze(0))
        if len(views) != 1 or not views[0].is_contiguous() or views[0].dtype != bucket.dtype:
            return None
        return [(tensor.hf_names[0], views[0].view(tensor.hf_shapes[0]))]

    async def _transfer(
        self,
        bucket: Bucket,
        schedule: list[Bucket],
        flat: torch.Tensor,
        named: list[tuple[str, torch.Tensor]],
        held: HeldEntries | None = None,
    ) -> None:
        """Send one bucket; with a collective transport, first take the token from the previous owner.
        With `held` (relayed copies), the holders are told when the engines answered, also on failure."""
        previous = schedule[bucket.index - 1].owner if bucket.index > 0 else self._rank
        following = schedule[bucket.index + 1].owner if bucket.index + 1 < len(schedule) else self._rank
        token = torch.zeros(1, dtype=torch.int32)
        try:
            if self.transport.serialized and previous != self._rank:
                await asyncio.to_thread(dist.recv, token, previous, self._control)
            await asyncio.wait_for(self.transport.send(flat, named, held), self.timeout_s)
            if self.transport.serialized and following != self._rank:
                await asyncio.to_thread(dist.send, token, following, self._control)
        except Exception as e:
            raise SyncError(f"{bucket.describe()}: {type(e).__name__}: {e}") from e
        finally:
            if held is not None and self.relay is not None:
                await asyncio.to_thread(self.relay.acknowledge)
