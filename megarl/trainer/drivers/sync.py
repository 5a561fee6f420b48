"""The synchronous PPO/GRPO driver (`trainer.driver=sync`): one training step per loop iteration, read top to
bottom.

Each step: prompts → uid, n samples each → rollout (agent loops on the engines) → engines sleep →
scores (in a driver thread, overlapping) → old log-probs (actor) → reference log-probs → values
(critic) → advantages on the driver → critic update → actor update (after critic warm-up) →
checkpoint when due → weight sync (engines wake with the new weights) → validation when due →
metrics.
"""

from megarl.trainer.collect import collect, due, evaluate, validation_due
from megarl.trainer.drivers.common import begin
from megarl.trainer.handover import to_rollout, to_training
from megarl.trainer.job import Job
from megarl.trainer.metrics import timer
from megarl.trainer.saving import finish, save_checkpoint, settle_checkpoint
from megarl.trainer.train_step import step_metrics, train_on


def fit(job: Job) -> None:
    """Train for `total_steps` steps from the latest checkpoint (or from scratch)."""
    cfg = job.cfg.trainer
    step, bar = begin(job)
    while step < job.total_steps:
        step += 1
        last = step == job.total_steps
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timings):
            with timer("gen", timings):
                batch, scores, gen_metrics = collect(job.rollout, job.prompts, step)
            with timer("engine_sleep", timings):
                metrics |= to_training(job)
            metrics |= gen_metrics | train_on(job.training, batch, scores, step, timings)
            if due(cfg.save_freq, step, last):
                with timer("save_checkpoint", timings):
                    save_checkpoint(job, step, metrics | timings)
            settle_checkpoint(job)
            with timer("sync", timings):
                metrics |= to_rollout(job, step)
            if validation_due(job.rollout, step, last):
                with timer("testing", timings):
                    metrics |= evaluate(job.rollout, step)
        metrics |= step_metrics(job.training, batch, timings, job.num_devices)
        job.tracker.log(metrics, step)
        bar.update(step, metrics)
    bar.close()
    finish(job)
