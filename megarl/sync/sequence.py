"""Colocated sequencing: who holds the device's memory at each moment around a weight sync.

Trainer and engine share the devices, so the order bounds the peak (W = weights, G+O = gradients
and optimizer state, KV = the engine's cache):

    to_rollout:   trainer frees G+O → engine wakes W → sync (W twice + 2 buckets) →
                  trainer frees its W → engine wakes KV (its cache was flushed by the sync)
    to_training:  engine releases KV and W → trainer reloads W, G+O
    vacate:       trainer frees W, G+O (before an engine restarts: `trainer.engine_recovery`);
                  the next to_rollout brings W back for the sync

Each offload ends with `free_cached_memory()`: the blocks go back from the trainer's CUDA caching allocator
to the device, where the engine can allocate them; after the sync that includes the bucket buffers (on CUDA
the executor keeps none between syncs; on CPU it keeps its shared-memory ones, host memory). `memory` has the
device memory the allocator reserved before `to_rollout` and when it hands the device over
(`handover/reserved_{before,after}_bytes`; 0 without CUDA).

At start-up the driver has the engines release KV and W as soon as they are healthy (`trainer/build.py`, before
any trainer role allocates), so the first step begins with `to_rollout`.

Every step runs on every rank of the role (engine calls from rank 0, the rest wait for it) with
`timeout_s`; a failure raises `SyncError` naming the step. Before it does, every engine that still answers is
taken back to the memory state the phase began with (`to_rollout` releases what it woke, `to_training` resumes
what it released), so that the caller can restart an engine that died in the phase, in that state, and run the
phase again (`megarl.trainer.handover`).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from megarl.engines.client.client import EngineClient
from megarl.engines.client.fleet import Fleet
from megarl.megatron.offload import Offloader, handover_memory, reserved_bytes
from megarl.megatron.optim import Trainable
from megarl.sync.executor import SyncError, WeightSyncer
from megarl.sync.metrics import SyncMetrics

T = TypeVar("T")
TRAINING_TAGS = ["kv_cache", "weights"]
"""What engines release while the trainer holds the devices; `to_rollout` resumes exactly these."""


class ColocatedSequence:
    def __init__(self, syncer: WeightSyncer, trainable: Trainable, engine_keeps_weights: bool) -> None:
        """`engine_keeps_weights`: the engine backs its weights up when asleep (else delta syncs send all)."""
        self.syncer = syncer
        self.state = Offloader(trainable, params=False, grads=True, optimizer=True)
        self.params = Offloader(trainable, params=True, grads=False, optimizer=False)
        self.engine_keeps_weights = engine_keeps_weights
        self.timings: dict[str, float] = {}
        self.memory: dict[str, float] = {}

    def _step(self, name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            result = fn()
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"colocated step {name!r} failed: {type(e).__name__}: {e}") from e
        self.timings[f"sync/{name}_s"] = time.perf_counter() - start
        return result

    def to_rollout(self, weight_version: str | None = None, full: bool = False) -> SyncMetrics:
        """Trainer → engines: returns the sync's metrics; step timings are in `timings`. `full`: every tensor
        even where the engines keep their weights asleep (an engine was restarted)."""
        woken: list[str] = []
        try:
            return self._to_rollout(weight_version, full, woken)
        except SyncError:
            self._rewind(woken, lambda client: client.release_memory_occupation(woken))
            raise

    def _to_rollout(self, weight_version: str | None, full: bool, woken: list[str]) -> SyncMetrics:
        """`to_rollout`, appending each tag to `woken` as the engines are asked to resume it."""
        before = reserved_bytes()
        self._step("trainer_free_state", self.state.offload)
        self.params.reload()  # `vacate` took them too; the sync reads them
        self._wake("engine_wake_weights", "weights", woken)
        metrics = self._step("weights", lambda: self.syncer.sync(weight_version, full or not self.engine_keeps_weights))
        self._step("trainer_free_params", self.params.offload)
        self.memory = handover_memory(before)
        self._wake("engine_wake_kv", "kv_cache", woken)
        return metrics

    def _wake(self, step: str, tag: str, woken: list[str]) -> None:
        woken.append(tag)
        self._step(step, lambda: self.syncer.call_engines(f"resume {tag}", lambda e: e.resume([tag])))

    def vacate(self) -> None:
        """Everything off the device, for an engine about to (re)start beside the trainer."""
        self.state.offload()
        self.params.offload()

    def to_training(self) -> None:
        """Engines → trainer."""
        try:
            self._step("engine_sleep", lambda: self.syncer.call_engines("release", lambda e: e.release(TRAINING_TAGS)))
        except SyncError:
            self._rewind(TRAINING_TAGS, lambda client: client.resume_memory_occupation(TRAINING_TAGS))
            raise
        self._step("trainer_reload", lambda: (self.params.reload(), self.state.reload()))

    def _rewind(self, tags: list[str], call: Callable[[EngineClient], Awaitable[object]]) -> None:
        """After a failed phase: `call` on every engine, for the `tags` the phase changed; an engine that fails it
        (it died, or never took the phase's call) is left as it is: the caller restarts the dead ones."""
        if not tags:
            return

        async def each(engines: Fleet) -> None:
            await asyncio.gather(*(call(client) for client in engines.clients), return_exceptions=True)

        self.syncer.call_engines(f"rewind {tags}", each)
