"""Spreads generation requests over engine replicas: least in-flight first, sticky per trajectory.

Multi-turn requests of one trajectory go to the replica that served its previous turn (an LRU map
of trajectory id → replica), so they reuse that replica's prefix cache. A replica that cannot be
reached is marked dead at once: it gets no new requests, each of its failing requests is retried
on another replica (from the start: partial output is lost), and a health check revives it when
it answers again.

Health loop (`start_health_checks`): every `health_interval_s` it polls each replica's
/health_generate; it runs until `close()` cancels it.
"""

import asyncio
import collections
import logging
from dataclasses import dataclass

from megarl.config.rollout import RolloutConfig
from megarl.engines.client import ClientTimeouts, EngineClient, EngineUnavailable
from megarl.engines.protocol import GenerateResult
from megarl.engines.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Replica:
    client: EngineClient
    in_flight: int = 0
    served: int = 0
    """Requests completed here."""
    alive: bool = True


class NoReplicaAvailable(RuntimeError):
    """Every replica is dead."""


class Router:
    def __init__(
        self, clients: list[EngineClient], sticky_capacity: int = 100_000, health_interval_s: float = 10.0
    ) -> None:
        if not clients:
            raise ValueError("the router needs at least one engine replica")
        self.replicas = [Replica(client=c) for c in clients]
        self.sticky_capacity = sticky_capacity
        self.health_interval_s = health_interval_s
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._health_task: asyncio.Task | None = None

    @classmethod
    def from_urls(cls, urls: list[str], sticky_capacity: int = 100_000) -> "Router":
        return cls([EngineClient(u) for u in urls], sticky_capacity=sticky_capacity)

    @classmethod
    def from_config(cls, cfg: RolloutConfig, urls: list[str]) -> "Router":
        """Clients with `rollout.request_timeout_s` per /generate; health checks every `health_check_interval_s`."""
        timeouts = ClientTimeouts(generate_s=cfg.request_timeout_s)
        return cls([EngineClient(u, timeouts=timeouts) for u in urls], health_interval_s=cfg.health_check_interval_s)

    def pick(self, trajectory_id: str | None = None) -> int:
        """The replica index for the next request: the trajectory's own if alive, else the least loaded."""
        if trajectory_id is not None and trajectory_id in self._sticky:
            index = self._sticky[trajectory_id]
            if self.replicas[index].alive:
                self._sticky.move_to_end(trajectory_id)
                return index
        alive = [i for i, r in enumerate(self.replicas) if r.alive]
        if not alive:
            raise NoReplicaAvailable(f"all {len(self.replicas)} engine replicas are down: {self._urls()}")
        index = min(alive, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].served))
        if trajectory_id is not None:
            self._sticky[trajectory_id] = index
            self._sticky.move_to_end(trajectory_id)
            while len(self._sticky) > self.sticky_capacity:
                self._sticky.popitem(last=False)
        return index

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool = False,
        trajectory_id: str | None = None,
        rid: str | None = None,
    ) -> list[GenerateResult]:
        """`sampling.n` samples from one replica; retried on another if that replica goes down."""
        while True:
            index = self.pick(trajectory_id)
            replica = self.replicas[index]
            replica.in_flight += 1
            try:
                results = await replica.client.generate(input_ids, sampling, return_logprob, rid)
            except EngineUnavailable as e:
                self._mark_dead(index, e)
                continue
            finally:
                replica.in_flight -= 1
            replica.served += 1
            return results

    async def abort(self, rid_prefix: str = "", abort_all: bool = False) -> None:
        """Abort matching requests on every live replica."""
        await asyncio.gather(*(r.client.abort_request(rid_prefix, abort_all) for r in self.replicas if r.alive))

    def _mark_dead(self, index: int, error: Exception) -> None:
        replica = self.replicas[index]
        if replica.alive:
            replica.alive = False
            logger.warning(
                "engine replica %d (%s) is down (%s); draining it: %d in-flight requests retry on %d other replicas",
                index,
                replica.client.url,
                error,
                replica.in_flight,
                sum(r.alive for r in self.replicas),
            )

    async def check_health(self) -> None:
        """Poll every replica once; mark the silent ones dead and revive the ones that answer again."""
        healthy = await asyncio.gather(*(r.client.health(timeout_s=30.0) for r in self.replicas))
        for index, (replica, ok) in enumerate(zip(self.replicas, healthy, strict=True)):
            if not ok:
                self._mark_dead(index, EngineUnavailable("health check failed"))
            elif not replica.alive:
                replica.alive = True
                logger.info("engine replica %d (%s) is healthy again", index, replica.client.url)

    def start_health_checks(self) -> None:
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    def _urls(self) -> list[str]:
        return [r.client.url for r in self.replicas]


async def generate_batch(
    router: Router, prompts: list[list[int]], sampling: SamplingParams, return_logprob: bool = False
) -> list[list[GenerateResult]]:
    """Single-turn RL: `sampling.n` samples for every prompt, all in flight at once, results in prompt order."""
    return list(await asyncio.gather(*(router.generate(p, sampling, return_logprob) for p in prompts)))
