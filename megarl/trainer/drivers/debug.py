"""Debug drivers that split rollout from training (`trainer.driver`):

- rollout_only: generate and score `total_steps` batches with the engines as loaded (no Megatron
  roles), save each as `<trainer.rollout_data_dir>/step_<k>.pt` and log rollout metrics;
- train_only: no engines; train on those saved batches in step order, as `sync` would after rollout.
"""

from pathlib import Path

from megarl.rewards.score import Scored
from megarl.trainer.collect import collect, done
from megarl.trainer.job import RolloutJob, TrainingJob
from megarl.trainer.metrics import timer
from megarl.trainer.rollout_dump import load_rollout_batches, save_rollout_batch
from megarl.trainer.saving import finish
from megarl.trainer.train_step import step_metrics, train_on


def rollout_only(job: RolloutJob) -> None:
    directory = Path(job.cfg.trainer.rollout_data_dir)
    for step in range(1, job.total_steps + 1):
        timings: dict[str, float] = {}
        with timer("step", timings):
            with timer("gen", timings):
                batch, scores, metrics = collect(job.rollout, job.prompts, step)
            with timer("reward", timings):
                scored = scores.result()
            scored.record(batch)
            save_rollout_batch(directory, step, batch)
        metrics |= scored.metrics | timings | {"reward/score/mean": scored.scores.mean().item()}
        job.tracker.log(metrics, step)
    finish(job)


def train_only(job: TrainingJob) -> None:
    directory = Path(job.cfg.trainer.rollout_data_dir)
    for step, batch in load_rollout_batches(directory)[: job.total_steps]:
        timings: dict[str, float] = {}
        with timer("step", timings):
            metrics = train_on(job.training, batch, done(Scored.of(batch)), step, timings)
        job.tracker.log(metrics | step_metrics(job.training, batch, timings, job.num_devices), step)
    finish(job)
