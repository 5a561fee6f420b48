"""A job's checkpoints and its end: save every trainable role with the trainer state, resume from the
checkpoint `trainer.resume_mode` names, close the logs and draw the run's plot.
"""

import logging
from pathlib import Path
from typing import Any

from megarl.trainer.checkpoint import load_trainer_state
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
    entries: the asynchronous drivers' loader position and producer state. An I/O error stops the run or
    is logged (trainer.on_checkpoint_error)."""
    training = job.training
    state = {"dataloader": job.prompts.loader.state_dict(), "kl_ctrl": training.kl_ctrl.state_dict()}
    state |= {"metrics": metrics} | (extra or {})

    def save_roles(staging: Path) -> list[OSError | None]:
        """Each trainable role saves under `staging / <role>`; each rank's I/O error comes back, or None."""
        groups = training.roles.trainable()
        return [error for group in groups for error in group.broadcast(RankWorker.save, str(staging / group.name))]

    job.checkpoints.save(step, save_roles, state, job.cfg.trainer.on_checkpoint_error)


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
    """Close the logs and draw `metrics.png` of the run."""
    basics.tracker.close()
    records = read_metrics(basics.run_dir / "metrics.jsonl")
    if records:
        keys = [k for k in DEFAULT_PLOT_KEYS if any(k in r for r in records)]
        if keys:
            logger.info("plot: %s", plot_metrics(records, basics.run_dir / "metrics.png", keys))
