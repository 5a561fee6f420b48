"""The hand-over between rollout and training, once per step (and around every asynchronous push):

to_training(job)   after the rollout: restart failed engines, the engines sleep and the actor is back on
                   the device (colocated; the actor's ColocatedSequence), then reference and critic
to_rollout(job)    reference and critic leave the device when they offload, engines that exited while
                   asleep are restarted (`megarl.trainer.recovery`), the actor pushes v<step> into every
                   engine (which wake); with LoRA adapter sync the rollout's requests name v<step>'s adapter
"""

from megarl.config.lora import adapter_name
from megarl.trainer.job import Job
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker


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
    full = recovery.before_rollout(vacate=lambda: max(roles.actor.broadcast(ActorWorker.vacate)))
    metrics |= roles.actor.broadcast(ActorWorker.to_rollout, f"v{step}", full)[0]
    lora = job.cfg.actor.lora
    if lora.enabled and lora.sync == "adapter":  # the engines hold v<step>'s adapter: requests name it from now on
        job.rollout.manager.use_adapter(adapter_name(f"v{step}"))
    return metrics | (recovery.after_sync() if readmit else {})


def to_training(job: Job) -> dict[str, float]:
    """Engines that died or hung in the rollout are restarted; engines asleep and the actor back on the device,
    then reference and critic."""
    metrics = job.rollout.recovery.before_training()
    job.training.roles.actor.broadcast(ActorWorker.to_training)
    for group in job.training.roles.offloading().values():
        group.broadcast(RankWorker.restore)
    return metrics
