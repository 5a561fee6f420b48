"""Engine recovery inside a step's hand-over (`megarl.trainer.handover`): which replicas to restart when, and
when to take them back.

    to_training:  before_training()   engines are awake after the rollout: restart the ones that died,
                                      hung (no /health_generate answer) or that a router gave up on
    to_rollout:   before_rollout()    engines are asleep (colocated): restart the ones whose server
                                      exited, once the trainer left the devices (`vacate`), and put
                                      them to sleep like the others; True = sync in full
                  ...the actor syncs every engine...
                  after_sync()        the routers take the restarted replicas back

No request is in flight on a replica being restarted: the router drained it when it failed (its
requests retried on the others) and the phases above run between rollouts. `EngineRecovery` belongs to
the rollout side of the job; only the drivers with both sides hand over.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.agents.manager import RolloutManager
from megarl.engines.replicas.supervisor import EngineSupervisor


@dataclass(kw_only=True)
class EngineRecovery:
    supervisor: EngineSupervisor
    rollout: RolloutManager
    release_tags: list[str] = field(default_factory=list)
    """What colocated engines release while the trainer holds the devices (empty: separate pools, never asleep)."""
    restarted: set[int] = field(default_factory=set)
    """Replicas restarted since the last sync: the routers still leave them out until `after_sync`."""
    held_at_restart: int | None = None
    """Bytes the trainer still held on the devices when asleep engines were restarted (`after_sync` reports it)."""

    def before_training(self) -> dict[str, float]:
        """Restart every replica that died, hung or was given up on during the rollout; `engines/…` metrics."""
        for index in self.supervisor.failed(self._suspects(), awake=True):
            self.supervisor.restart(index)
            self.restarted.add(index)
        return self.supervisor.metrics()

    def _suspects(self) -> set[int]:
        return self.rollout.dead_replicas() - self.restarted

    def before_rollout(self, vacate: Callable[[], int]) -> bool:
        """Restart every replica whose server exited while the engines slept; whether the next sync must be
        full (a restarted engine holds the checkpoint's weights, not the last version).

        Colocated (`release_tags`), `vacate()` first takes the trainer off the devices and empties its cache; it
        returns the bytes the trainer still holds there. SGLang sizes its KV cache pool from the memory free once
        its weights are loaded (model_runner.py `profile_max_num_token`; none left: "Not enough memory"), so an
        engine started beside a trainer that holds its memory gets almost none. Separate pools (the asynchronous
        drivers too) give engines devices of their own: nothing to vacate. The reference and critic left before
        (`to_rollout`) when they offload."""
        restarted = self.supervisor.failed(self._suspects(), awake=False)
        if restarted and self.release_tags:
            self.held_at_restart = vacate()
        for index in restarted:
            self.supervisor.restart(index)
        if restarted and self.release_tags:
            engines = self.supervisor.engines
            engines.wait(engines.only(restarted).release(self.release_tags))
        self.restarted |= set(restarted)
        return bool(self.restarted)

    def after_sync(self) -> dict[str, float]:
        """Once every engine holds the current weights, the routers take restarted replicas back."""
        if not self.restarted:
            return {}
        self.restarted = set()
        metrics = self.rollout.readmit() | self.supervisor.metrics()
        if self.held_at_restart is not None:
            metrics["engines/trainer_bytes_at_restart"] = float(self.held_at_restart)
            self.held_at_restart = None
        return metrics
