"""Engine recovery: replicas that died or hung are restarted in place, within a bound.

The router already drains a replica that stops answering: its in-flight requests retry on the
others. The supervisor brings it back between the phases of a step, where no request is in
flight on it:

    recover(suspects, awake)   # the replicas the routers gave up on, or whose process exited, or that
                               # do not answer /health_generate (awake engines only) are restarted:
                               # same command, node and port; a full weight sync must follow
    ...the weight sync...
    router.check_health()      # the callers re-admit a replica once it holds the current weights

A restarted engine comes up awake with the checkpoint's weights. Its caller puts it to sleep when
the other engines sleep (`EngineRecovery.release_tags`) and syncs it in full (delta sync assumes an engine holds
the last version). `max_restarts_per_replica` and `max_restarts` bound the restarts; past them
`EngineLost` names the replica, its log and its last lines.
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from megarl.engines.client.fleet import Fleet
from megarl.engines.client.sglang_api import HEALTH_PATH
from megarl.engines.replicas.replica import ReplicaHandle

logger = logging.getLogger(__name__)


class EngineLost(RuntimeError):
    """A replica failed more often than the restart bounds allow."""


@dataclass(kw_only=True, slots=True)
class RestartBounds:
    per_replica: int = 3
    per_run: int = 10
    start_timeout_s: float = 900.0
    """Seconds a restarted replica may take to answer its health check."""
    health_timeout_s: float = 30.0
    """Seconds an awake replica may take to answer /health_generate before it counts as hung."""


@dataclass(kw_only=True)
class EngineSupervisor:
    replicas: list[ReplicaHandle]
    engines: Fleet
    """The replicas' clients (a restarted replica keeps its URL)."""
    bounds: RestartBounds = field(default_factory=RestartBounds)
    restarts: list[int] = field(default_factory=list)
    """Restarts so far, per replica."""
    down_s: float = 0.0
    """Seconds replicas spent out of service, from the check that found them to healthy again, summed."""

    def __post_init__(self) -> None:
        self.restarts = [0] * len(self.replicas)

    def failed(self, suspects: Iterable[int], awake: bool) -> list[int]:
        """Replicas to restart: the `suspects` (the routers marked them dead), the ones whose server exited, and,
        when the engines are `awake`, the ones that do not answer /health_generate in time (hung)."""
        down = set(suspects) | {i for i, replica in enumerate(self.replicas) if not replica.alive()}
        if awake:
            answers = self.engines.wait(self.engines.health(self.bounds.health_timeout_s))
            down |= {i for i, ok in enumerate(answers) if not ok}
        return sorted(down)

    def restart(self, index: int) -> None:
        """Restart replica `index` (killing a hung server) and wait until it is healthy; `EngineLost` past the
        bounds."""
        replica = self.replicas[index]
        if self.restarts[index] >= self.bounds.per_replica or sum(self.restarts) >= self.bounds.per_run:
            raise EngineLost(self._lost_message(index))
        started = time.perf_counter()
        logger.warning("engine replica %d (%s) died or hung; restarting it (log %s)", index, replica.url, _log(replica))
        replica.restart(HEALTH_PATH, self.bounds.start_timeout_s)
        self.restarts[index] += 1
        self.down_s += time.perf_counter() - started
        logger.info("engine replica %d is back after %.1f s", index, time.perf_counter() - started)

    def _lost_message(self, index: int) -> str:
        replica = self.replicas[index]
        tail = "\n".join(f"    {line}" for line in replica.log_tail()) or "    (no output)"
        return (
            f"engine replica {index} ({replica.url}) failed again after {self.restarts[index]} restart(s) "
            f"({sum(self.restarts)} in this run; bounds: rollout.max_engine_restarts_per_replica="
            f"{self.bounds.per_replica}, rollout.max_engine_restarts={self.bounds.per_run}); "
            f"its log: {_log(replica)}\n  last lines:\n{tail}"
        )

    def metrics(self) -> dict[str, float]:
        return {"engines/restarts": float(sum(self.restarts)), "engines/down_s": self.down_s}


def _log(replica: ReplicaHandle) -> str:
    return replica.log_paths[0] if replica.log_paths else "(not started)"
