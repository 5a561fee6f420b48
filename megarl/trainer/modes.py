"""Debug drivers that split rollout from training (`trainer.mode`):

- rollout_only: generate and score `total_steps` batches with the engines as loaded (no Megatron
  roles), save each as `<trainer.rollout_data_dir>/step_<k>.pt` and log rollout metrics;
- train_only: no engines; train on those saved batches in step order, as `fit` would after rollout.
"""

from concurrent.futures import Future
from pathlib import Path

from megarl.rewards.score import Scored
from megarl.trainer.driver import Trainer
from megarl.trainer.metrics import timer
from megarl.trainer.rollout_dump import load_rollout_batches, save_rollout_batch


def rollout_only(trainer: Trainer) -> None:
    directory = Path(trainer.cfg.trainer.rollout_data_dir)
    for step in range(1, trainer.total_steps + 1):
        timings: dict[str, float] = {}
        with timer("step", timings):
            with timer("gen", timings):
                batch, scores, metrics = trainer.collect(step)
            with timer("reward", timings):
                scored = scores.result()
            scored.record(batch)
            save_rollout_batch(directory, step, batch)
        metrics |= scored.metrics | timings | {"reward/score/mean": scored.scores.mean().item()}
        trainer.tracker.log(metrics, step)
    trainer.finish()


def train_only(trainer: Trainer) -> None:
    directory = Path(trainer.cfg.trainer.rollout_data_dir)
    for step, batch in load_rollout_batches(directory)[: trainer.total_steps]:
        timings: dict[str, float] = {}
        scores: Future[Scored] = Future()
        scores.set_result(Scored.of(batch))
        with timer("step", timings):
            metrics = trainer.train_on(batch, scores, step, timings)
        trainer.tracker.log(metrics | trainer.step_metrics(batch, timings), step)
    trainer.finish()
