"""`WorkerGroup[W]`: the driver's handle on one role's ranks, each a `W` (a `RankWorker`). The worker method is
named by the class attribute, so mypy checks its arguments and result; dispatch is chosen at each call:

    actor = WorkerGroup(ActorWorker, pool, "actor")                           # WorkerGroup[ActorWorker]
    actor.broadcast(ActorWorker.setup, cfg, total_steps, urls)                # same arguments to every rank
    outputs = actor.split_dp(ActorWorker.compute_log_prob, batch)             # DP shard d to every rank of DP rank d
    log_probs = actor.from_dp_leaders(outputs)                                # one result per DP shard, in order
    metrics = actor.split_dp(ActorWorker.update, batch, step)[0]              # reduced inside: any rank's copy

`split_dp` cuts the batch into `dp_size` equal consecutive shards; the caller orders the rows first
(see megarl.trainer.balance) when it wants shards of equal token counts.
"""

import time
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import RayActorError, RayError

from megarl.batch import Batch
from megarl.workers.base import DPCoords, GuardStop, RankWorker
from megarl.workers.placement import ResourcePool

W = TypeVar("W", bound=RankWorker, covariant=True)
"""The role's worker class (covariant: a `WorkerGroup[ActorWorker]` is a `WorkerGroup[RankWorker]`)."""
P = ParamSpec("P")
R = TypeVar("R")


class RankFailure(RuntimeError):
    """A rank of a role died, raised, or did not finish a call its peers finished. `retriable`: whether a fresh start
    of the run may get past it (False when the rank stopped the run on purpose: `GuardStop`)."""

    def __init__(self, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class WorkerGroup(Generic[W]):
    def __init__(
        self,
        cls: type[W],
        pool: ResourcePool,
        name: str,
        init_timeout_s: float = 1800.0,
        failure_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """One `cls` actor per bundle of `pool`, joined in a torch.distributed world of their own. Every call
        waits for all ranks, but a rank that dies or raises ends the wait at once (`RankFailure`), and so do
        peers still running `failure_timeout_s` after one finished. `env`: variables set in every rank's process."""
        remote = ray.remote(cls)
        self.name = name
        self.failure_timeout_s = failure_timeout_s
        self.nodes = [site.node_ip for site in pool.sites]
        self.workers: list[Any] = [
            remote.options(
                **pool.share(),
                scheduling_strategy=pool.strategy(rank),
                name=f"megarl-{name}-{rank}",
                runtime_env={"env_vars": env or {}},
            ).remote(rank, pool.num_devices, pool.device)
            for rank in range(pool.num_devices)
        ]
        """ray.actor.ActorHandle each (Ray ships no type information)."""
        address, port = ray.get(self.workers[0].rendezvous.remote())
        self._gather(
            "init_process_group", [w.init_process_group.remote(address, port, init_timeout_s) for w in self.workers]
        )
        self._coords: list[DPCoords] = []
        self.dispatch_seconds = 0.0
        """Driver time spent cutting and shipping batches in `split_dp` (the caller resets it)."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def broadcast(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`method(*args, **kwargs)` on every rank; the results in rank order."""
        refs = [ray.put(a) for a in args]
        return self._gather(method.__name__, [_remote(w, method)(*refs, **kwargs) for w in self.workers])

    def _gather(self, method: str, refs: list[Any]) -> list[Any]:
        """The results in rank order, or `RankFailure` as soon as a rank fails or its peers stall."""
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            timeout = None if len(pending) == len(refs) else self.failure_timeout_s
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                ranks = sorted(refs.index(ref) for ref in pending)
                raise RankFailure(
                    f"{self.name} ranks {ranks} (nodes {sorted({self.nodes[r] for r in ranks})}) did not finish "
                    f"{method} within trainer.failure_timeout_s={self.failure_timeout_s:g} s of their peers"
                )
            rank = refs.index(done[0])
            try:
                results[rank] = ray.get(done[0])
            except RayError as err:
                guard = isinstance(getattr(err, "cause", None), GuardStop)
                raise RankFailure(self._failure(rank, method, err), retriable=not guard) from None
        return results

    def _failure(self, rank: int, method: str, err: RayError) -> str:
        what = "died" if isinstance(err, RayActorError) else "raised"
        lines = "\n".join(f"    {line}" for line in _tail(str(err), 25))
        logs = _log_tail(self.workers[rank])
        return (
            f"{self.name} rank {rank} (Ray actor megarl-{self.name}-{rank} on node {self.nodes[rank]}) {what} in "
            f"{method}:\n{lines}" + (f"\n  its log (last lines):\n{logs}" if logs else "")
        )

    def coords(self) -> list[DPCoords]:
        """Each rank's DP coordinates (after `setup` built the role's groups)."""
        if not self._coords:
            self._coords = ray.get([w.dp_coords.remote() for w in self.workers])
        return self._coords

    @property
    def dp_size(self) -> int:
        return self.coords()[0].dp_size

    def split_dp(
        self, method: Callable[Concatenate[W, Batch, P], R], batch: Batch, *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """`method(shard_d, *args, **kwargs)` on every rank of DP rank d; the results in rank order."""
        start = time.perf_counter()
        shards = [ray.put(shard) for shard in batch.chunk(self.dp_size)]
        extra = [ray.put(a) for a in args]
        self.dispatch_seconds += time.perf_counter() - start
        return self._gather(
            method.__name__,
            [
                _remote(w, method)(shards[c.dp_rank], *extra, **kwargs)
                for w, c in zip(self.workers, self.coords(), strict=True)
            ],
        )

    def from_dp_leaders(self, results: list[Batch]) -> Batch:
        """The DP leaders' results concatenated in DP order (the rows of the batch given to split_dp)."""
        by_dp = {c.dp_rank: r for c, r in zip(self.coords(), results, strict=True) if c.leader}
        return Batch.concat([by_dp[d] for d in range(self.dp_size)])

    def shutdown(self) -> None:
        """Kill the ranks (also those stuck in a collective after a peer failed)."""
        for worker in self.workers:
            ray.kill(worker)


def _remote(worker: Any, method: Callable[..., Any]) -> Any:
    """The Ray actor's `.remote` of the worker class's `method` (the one place a method is looked up by name)."""
    return getattr(worker, method.__name__).remote


def _tail(text: str, count: int) -> list[str]:
    return text.strip().splitlines()[-count:]


def _log_tail(worker: Any, count: int = 20) -> str:
    """The last stderr lines of a rank's Ray worker process, where Ray's log service still has them."""
    from ray.util.state import get_log

    try:
        text = "".join(get_log(actor_id=worker._actor_id.hex(), suffix="err", tail=count, timeout=10))
    except Exception:  # best effort: the node or its log agent may be gone with the rank
        return ""
    return "\n".join(f"    {line}" for line in _tail(text, count))
