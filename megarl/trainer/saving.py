"""A job's checkpoints and its end: save every trainable role with the trainer state, resume from the
checkpoint `trainer.resume_mode` names, close the logs and draw the run's plot.
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.trainer.checkpoint import export_hf, load_trainer_state
from megarl.trainer.job import Basics, Job, SFTJob
from megarl.trainer.plot import DEFAULT_PLOT_KEYS, plot_metrics
from megarl.trainer.tracking import read_metrics
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.critic import CriticWorker

logger = logging.getLogger("megarl")


def save_checkpoint(
    job: Job | SFTJob, step: int, metrics: dict[str, float], extra: dict[str, Any] | None = None
) -> None:
    """Every trainable role, the loader position, the KL controller, and the step's metrics so far
    (a run killed before it logs them logs them on resume). `extra` adds to (or replaces) trainer state
    entries: the asynchronous drivers' loader position and producer state. With trainer.async_save the roles only
    stage their state here; `settle_checkpoint` commits it once written (and waits for a save still in flight
    first). An I/O error stops the run or is logged (trainer.on_checkpoint_error)."""
    t = job.cfg.trainer
    settle_checkpoint(job, blocking=True)
    state = {"dataloader": job.prompts.loader.state_dict(), "kl_ctrl": job.training.kl_ctrl.state_dict()}
    state |= {"metrics": metrics} | (extra or {})
    groups = job.training.roles.trainable()

    def save_roles(staging: Path) -> list[OSError | None]:
        """Each trainable role saves (or stages) under `staging / <role>`; each rank's I/O error comes back, or None."""
        path = {group.name: str(staging / group.name) for group in groups}
        errors = [error for g in groups for error in g.broadcast(RankWorker.save, path[g.name], t.async_save)]
        if not t.async_save and t.save_hf_weights and not any(errors):
            _hf_export(job)(staging)
        return errors

    if t.async_save:
        job.checkpoints.start(step, save_roles, state, t.on_checkpoint_error)
    else:
        job.checkpoints.save(step, save_roles, state, t.on_checkpoint_error)


def settle_checkpoint(job: Job | SFTJob, blocking: bool = False) -> None:
    """Commit the asynchronous save in flight once every rank of every trainable role has written its part and the HF
    export (trainer.save_hf_weights, started in a thread once they have) returned; `blocking`: wait for both. Called
    every step (a look at the writers, collective over each role) and before the run ends."""
    if job.checkpoints.pending is None:
        return
    groups = job.training.roles.trainable()
    staging = job.checkpoints.staging_dir(job.checkpoints.pending.step)

    def written() -> bool:
        results = [done for g in groups for done in g.broadcast(RankWorker.finish_saves, blocking, str(staging))]
        for result in results:
            if isinstance(result, OSError):
                raise result
        return all(results)

    export = _hf_export(job) if job.cfg.trainer.save_hf_weights else None
    job.checkpoints.finish(written, export, blocking)


def _hf_export(job: Job | SFTJob) -> Callable[[Path], Path]:
    """Writes a staged checkpoint's actor as HF safetensors under `actor/hf` (`checkpoint.export_hf`)."""
    cfg = job.cfg
    return lambda staging: export_hf(staging / "actor", cfg.model.path, lora=cfg.actor.lora.enabled)


def resume(job: Job | SFTJob) -> int:
    """Load `trainer.resume_mode`'s checkpoint into every role and the loader, keep its trainer state in
    `job.resumed_state`; returns its step (0 if none)."""
    path = job.checkpoints.resolve(job.cfg.trainer.resume_mode)
    if path is None:
        return 0
    roles = job.training.roles
    roles.actor.broadcast(ActorWorker.load, str(path / "actor"))
    if roles.critic is not None:
        roles.critic.broadcast(CriticWorker.load, str(path / "critic"))
    state = job.resumed_state = load_trainer_state(path)
    job.prompts.loader.load_state_dict(state["dataloader"])
    job.training.kl_ctrl.load_state_dict(state["kl_ctrl"])
    step = int(state["global_step"])
    if step not in job.tracker.logged_steps():
        job.tracker.log(state["metrics"], step)
    logger.info("resumed from %s (step %d)", path, step)
    return step


def finish(basics: Basics) -> None:
    """Commit the checkpoint still being written (if any), close the logs and draw `metrics.png` of the run."""
    if isinstance(basics, Job | SFTJob):
        settle_checkpoint(basics, blocking=True)
    basics.tracker.close()
    records = read_metrics(basics.run_dir / "metrics.jsonl")
    if records:
        keys = [k for k in DEFAULT_PLOT_KEYS if any(k in r for r in records)]
        if keys:
            logger.info("plot: %s", plot_metrics(records, basics.run_dir / "metrics.png", keys))
