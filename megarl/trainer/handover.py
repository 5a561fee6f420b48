"""The hand-over between rollout and training, once per step (and around every asynchronous push):

to_training(job)   after the rollout: restart failed engines, the engines sleep and the actor is back on
                   the device (colocated; the actor's ColocatedSequence), then reference and critic
to_rollout(job)    reference and critic leave the device when they offload, engines that exited while
                   asleep are restarted (`megarl.trainer.recovery`), the actor pushes v<step> into every
                   engine (which wake); with LoRA adapter sync the rollout's requests name v<step>'s adapter

An engine that dies inside either (its server exits while it wakes, takes the weights or sleeps) fails the actor's
call; the engines that still answer are back where the phase began (`megarl.sync.sequence`). The phase then runs
once more, and its recovery restarts the dead replica like any other (`EngineLost` past the bounds). A failure with
every engine's server running is the actor's error (`RankFailure`).
"""

import logging
from collections.abc import Callable
from typing import TypeVar

from megarl.config.lora import adapter_name
from megarl.trainer.job import Job
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.group import RankFailure

logger = logging.getLogger("megarl")
T = TypeVar("T")


def to_rollout(job: Job, step: int, readmit: bool = True) -> dict[str, float]:
    """Reference and critic leave the device if they offload; engines that exited while asleep are restarted
    (colocated: once the actor left the device too); then the actor syncs v<step> into the engines (in full
    after a restart, which is then taken back). `readmit`: the restarted engines rejoin the router now, asked for
    their health (False: the caller does it, `recovery.after_sync`, once paused engines continued: a paused engine
    answers /health_generate with 503)."""
    roles, recovery = job.training.roles, job.rollout.recovery
    metrics: dict[str, float] = {}
    for name, group in roles.offloading().items():
        released = group.broadcast(RankWorker.release)[0]  # rank 0's; empty without offload
        # offload/bytes → offload/ref_bytes, handover/reserved_before_bytes → handover/ref_reserved_before_bytes
        metrics |= {key.replace("/", f"/{name}_", 1): value for key, value in released.items()}
    metrics |= _again_if_engines_died(job, lambda: _sync(job, step))
    lora = job.cfg.actor.lora
    if lora.enabled and lora.sync == "adapter":  # the engines hold v<step>'s adapter: requests name it from now on
        job.rollout.manager.use_adapter(adapter_name(f"v{step}"))
    return metrics | (recovery.after_sync() if readmit else {})


def to_training(job: Job) -> dict[str, float]:
    """Engines that died or hung in the rollout are restarted; engines asleep and the actor back on the device,
    then reference and critic."""
    metrics = _again_if_engines_died(job, lambda: _sleep_engines(job))
    for group in job.training.roles.offloading().values():
        group.broadcast(RankWorker.restore)
    return metrics


def _sync(job: Job, step: int) -> dict[str, float]:
    """Engines whose server exited restart (colocated: once the actor left the devices), then the actor pushes
    v<step> (in full after a restart)."""
    actor = job.training.roles.actor
    full = job.rollout.recovery.before_rollout(vacate=lambda: max(actor.broadcast(ActorWorker.vacate)))
    return actor.broadcast(ActorWorker.to_rollout, f"v{step}", full)[0]


def _sleep_engines(job: Job) -> dict[str, float]:
    """Engines that failed in the rollout restart, then they sleep and the actor is back (colocated)."""
    metrics = job.rollout.recovery.before_training()
    job.training.roles.actor.broadcast(ActorWorker.to_training)
    return metrics


def _again_if_engines_died(job: Job, phase: Callable[[], T]) -> T:
    """`phase()`; if the actor failed in it while an engine's server had exited, `phase()` once more (it restarts
    that engine first)."""
    try:
        return phase()
    except RankFailure as err:
        died = job.rollout.recovery.died_in_handover()
        if not died:
            raise
        cause = str(err).splitlines()[0]
        logger.warning("hand-over: engine replica(s) %s died in it (%s); restarting, handing over again", died, cause)
    return phase()
