"""`trainer.driver=one_step_off`: step s trains the batch rolled out while step s − 1 trained (by v<s−2>); the
weights move between steps while the engines are idle, so every sample is exactly one version old and no
rollout crosses an update. Needs `trainer.placement=separate` (the engines keep their own devices).
"""

from concurrent.futures import Future, ThreadPoolExecutor

from megarl.trainer.collect import collect, due, evaluate, validation_due
from megarl.trainer.drivers.common import begin
from megarl.trainer.drivers.staleness import staleness_metrics
from megarl.trainer.handover import to_rollout
from megarl.trainer.job import Job
from megarl.trainer.metrics import timer
from megarl.trainer.saving import finish, save_checkpoint, settle_checkpoint
from megarl.trainer.train_step import step_metrics, train_on


def one_step_off(job: Job) -> None:
    """Train `total_steps` steps, each on the rollout that ran during the previous step.

    Consumes: the prompt stream, one step ahead. Waits for: the rollout of the step about to train.
    Shuts down: the last step starts no rollout; the executor ends with the loop. A checkpoint saves the
    loader position from before the in-flight rollout drew its prompts, so a resume rolls them out again.
    """
    step, bar = begin(job)
    engine_version = step
    executor = ThreadPoolExecutor(1, thread_name_prefix="megarl-next-rollout")
    before, pending = _launch(executor, job, step + 1)
    while step < job.total_steps:
        step += 1
        last = step == job.total_steps
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timings):
            with timer("wait_rollout", timings):
                batch, scores, gen_metrics = pending.result()
            if engine_version < step - 1:
                with timer("sync", timings):
                    metrics |= to_rollout(job, step - 1)  # the engines are idle: nothing in flight
                engine_version = step - 1
            if not last:
                before, pending = _launch(executor, job, step + 1)
            metrics |= gen_metrics | train_on(job.training, batch, scores, step, timings)
            if due(job.cfg.trainer.save_freq, step, last):
                with timer("save_checkpoint", timings):
                    save_checkpoint(job, step, metrics | timings, extra={"dataloader": before})
            settle_checkpoint(job)
            if validation_due(job.rollout, step, last):
                pending.result()  # validation evaluates v<step>: push it once the next rollout is done
                with timer("testing", timings):
                    metrics |= to_rollout(job, step) | evaluate(job.rollout, step)
                engine_version = step
        metrics |= step_metrics(job.training, batch, timings, job.num_devices)
        metrics |= staleness_metrics(batch["rollout_versions"], step - 1)
        job.tracker.log(metrics, step)
        bar.update(step, metrics)
    executor.shutdown()
    bar.close()
    finish(job)


def _launch(executor: ThreadPoolExecutor, job: Job, step: int) -> tuple[dict[str, int], Future]:
    """The loader position before step `step`'s rollout draws its prompts, and that rollout, started."""
    return job.prompts.loader.state_dict(), executor.submit(collect, job.rollout, job.prompts, step)
