"""Engine recovery inside a step's hand-over (`megarl.trainer.handover`): which replicas to restart when, and
when to take them back.

    to_training:  before_training()   engines are awake after the rollout: restart the ones that died,
                                      hung (no /health_generate answer) or that a router gave up on
    to_rollout:   before_rollout()    engines are asleep (colocated): restart the ones whose server
                                      exited, once the trainer left the devices (`vacate`), and put
                                      them to sleep like the others; True = sync in full
                  ...the actor syncs every engine...
                  after_sync()        the routers take the restarted replicas back
    asynchronous push (separate pools): before_pause() restarts the dead replicas before the engines pause, then
                  to_rollout as above

An engine that dies inside a phase's hand-over fails the actor's call; `died_in_handover()` names the replicas whose
server exited, and the phase runs again (`megarl.trainer.handover`), restarting them in its own recovery step.

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
    handovers_again: int = 0
    """Hand-overs run again because an engine died inside them (`died_in_handover`)."""

    def before_training(self) -> dict[str, float]:
        """Restart every replica that died, hung or was given up on during the rollout; `engines/…` metrics."""
        self._restart(self.supervisor.failed(self._suspects(), awake=True))
        return self._metrics()

    def before_pause(self) -> None:
        """Separate pools, before an asynchronous push pauses the engines (a dead one cannot be paused): restart
        every replica whose server exited or that a router gave up on. The push's `before_rollout` then asks for a
        full sync and `after_sync` readmits them."""
        assert not self.release_tags, "colocated engines restart in before_rollout, once the trainer left the devices"
        self._restart(self.supervisor.failed(self._suspects(), awake=False))

    def _restart(self, indices: list[int]) -> None:
        for index in indices:
            self.supervisor.restart(index)
            self.restarted.add(index)

    def died_in_handover(self) -> list[int]:
        """After a failed hand-over: the replicas whose server exited or that a router gave up on (the phase's
        recovery step restarts them when it runs again, which this counts: `engines/handovers_again`)."""
        died = self.supervisor.failed(self._suspects(), awake=False)
        self.handovers_again += bool(died)
        return died

    def _metrics(self) -> dict[str, float]:
        return self.supervisor.metrics() | {"engines/handovers_again": float(self.handovers_again)}

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
        self._restart(restarted)
        if restarted and self.release_tags:
            engines = self.supervisor.engines
            engines.wait(engines.only(restarted).release(self.release_tags))
        return bool(self.restarted)

    def after_sync(self) -> dict[str, float]:
        """Once every engine holds the current weights, the routers take restarted replicas back."""
        if not self.restarted:
            return {}
        self.restarted = set()
        metrics = self.rollout.readmit() | self._metrics()
        if self.held_at_restart is not None:
            metrics["engines/trainer_bytes_at_restart"] = float(self.held_at_restart)
            self.held_at_restart = None
        return metrics
