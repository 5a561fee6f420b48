"""`WorkerGroup`: the driver's handle on one role's ranks. Dispatch is chosen at each call:

    actor = WorkerGroup(ActorWorker, pool, "actor")
    actor.broadcast("setup", cfg, total_steps, urls)                   # same arguments to every rank
    outputs = actor.split_dp("compute_log_prob", batch)                 # DP shard d to every rank of DP rank d
    log_probs = actor.from_dp_leaders(outputs)                          # one result per DP shard, in order
    metrics = actor.split_dp("update", batch, step)[0]                  # reduced inside: any rank's copy

`split_dp` cuts the batch into `dp_size` equal consecutive shards; the caller orders the rows first
(see megarl.trainer.balance) when it wants shards of equal token counts.
"""

import time
from typing import Any

import ray

from megarl.protocol import Batch
from megarl.workers.base import DPCoords, RankWorker
from megarl.workers.placement import ResourcePool


class WorkerGroup:
    def __init__(self, cls: type[RankWorker], pool: ResourcePool, name: str, init_timeout_s: float = 1800.0) -> None:
        """One `cls` actor per bundle of `pool`, joined in a torch.distributed world of their own."""
        remote = ray.remote(cls)
        self.name = name
        self.workers: list[Any] = [
            remote.options(
                **pool.share(), scheduling_strategy=pool.strategy(rank), name=f"megarl-{name}-{rank}"
            ).remote(rank, pool.num_devices, pool.device)
            for rank in range(pool.num_devices)
        ]
        """ray.actor.ActorHandle each (Ray ships no type information)."""
        address, port = ray.get(self.workers[0].rendezvous.remote())
        ray.get([w.init_process_group.remote(address, port, init_timeout_s) for w in self.workers])
        self._coords: list[DPCoords] = []
        self.dispatch_seconds = 0.0
        """Driver time spent cutting and shipping batches in `split_dp` (the caller resets it)."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every rank; the results in rank order."""
        refs = [ray.put(a) for a in args]
        return ray.get([getattr(w, method).remote(*refs, **kwargs) for w in self.workers])

    def coords(self) -> list[DPCoords]:
        """Each rank's DP coordinates (after `setup` built the role's groups)."""
        if not self._coords:
            self._coords = ray.get([w.dp_coords.remote() for w in self.workers])
        return self._coords

    @property
    def dp_size(self) -> int:
        return self.coords()[0].dp_size

    def split_dp(self, method: str, batch: Batch, *args: Any) -> list[Any]:
        """`method(shard_d, *args)` on every rank of DP rank d; the results in rank order."""
        start = time.perf_counter()
        shards = [ray.put(shard) for shard in batch.chunk(self.dp_size)]
        extra = [ray.put(a) for a in args]
        self.dispatch_seconds += time.perf_counter() - start
        return ray.get(
            [
                getattr(w, method).remote(shards[c.dp_rank], *extra)
                for w, c in zip(self.workers, self.coords(), strict=True)
            ]
        )

    def from_dp_leaders(self, results: list[Batch]) -> Batch:
        """The DP leaders' results concatenated in DP order (the rows of the batch given to split_dp)."""
        by_dp = {c.dp_rank: r for c, r in zip(self.coords(), results, strict=True) if c.leader}
        return Batch.concat([by_dp[d] for d in range(self.dp_size)])

    def shutdown(self) -> None:
        """Kill the ranks (also those stuck in a collective after a peer failed)."""
        for worker in self.workers:
            ray.kill(worker)
