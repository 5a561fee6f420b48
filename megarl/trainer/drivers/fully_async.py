"""`trainer.driver=fully_async`: a `RolloutProducer` thread keeps groups in flight; each step takes
`train_batch_size` finished groups no older than `max_staleness` from a `GroupBuffer`, and every `sync_every`
steps the weights are pushed across in-flight requests (pause in `pause_mode`, update, continue) (docs/async.md).

Needs `trainer.placement=separate`: the engines keep their own devices while the trainer updates, so an engine
restarted before a push (`handover.to_rollout` → `EngineRecovery.before_rollout`) loads beside no trainer
memory. Weight versions are step numbers: the engines serve "v<k>" after the push of step k's weights, and the
trainer's current version at step s is s − 1 (`megarl.trainer.drivers.staleness`).
"""

import logging

from megarl.agents.manager import rollout_metrics
from megarl.batch import Batch
from megarl.rewards.score import Scored
from megarl.trainer.collect import done, due, evaluate, validation_due
from megarl.trainer.drivers.common import begin
from megarl.trainer.drivers.group_buffer import Group, GroupBuffer, taken_ages
from megarl.trainer.drivers.producer import RolloutProducer
from megarl.trainer.drivers.staleness import staleness_metrics
from megarl.trainer.handover import to_rollout
from megarl.trainer.job import Job
from megarl.trainer.metrics import timer
from megarl.trainer.saving import finish, save_checkpoint, settle_checkpoint
from megarl.trainer.train_step import step_metrics, train_on

logger = logging.getLogger("megarl")
TAKE_POLL_S = 1.0
"""How often a waiting step checks that the producer can still deliver its groups."""


def fully_async(job: Job) -> None:
    """Train `total_steps` steps on groups a producer rolls out continuously (module docstring).

    Consumes: finished groups from the buffer. Waits for: `train_batch_size` fresh ones. Shuts down: after
    the last step, or on any error, the producer is stopped (it cancels what is in flight; a checkpoint
    already lists those prompts) and its own error, if any, is raised.
    """
    step, bar = begin(job)
    buffer = GroupBuffer()
    resumed = job.resumed_state.get("async")
    if resumed is not None:
        logger.info(
            "async: resuming with %d drawn prompt group(s) to roll out again, then stream index %d",
            len(resumed["owed"]),
            resumed["next_index"],
        )
    producer = RolloutProducer(job, buffer, engine_version=step, resumed=resumed)
    producer.start()
    try:
        while step < job.total_steps:
            step += 1
            metrics = _async_step(job, producer, buffer, step)
            job.tracker.log(metrics, step)
            bar.update(step, metrics)
    finally:
        producer.stop()
    bar.close()
    finish(job)


def _async_step(job: Job, producer: RolloutProducer, buffer: GroupBuffer, step: int) -> dict[str, float]:
    cfg, last = job.cfg, step == job.total_steps
    timings: dict[str, float] = {}
    with timer("step", timings):
        with timer("wait_rollout", timings):
            groups, metrics = _take_fresh(job, producer, buffer, step)
        batch = Batch.concat([group.batch for group in groups])
        metrics |= rollout_metrics(batch) | train_on(job.training, batch, done(Scored.concat(groups)), step, timings)
        if due(cfg.trainer.save_freq, step, last):
            with timer("save_checkpoint", timings):
                snapshot = producer.snapshot()
                extra = {"dataloader": snapshot.pop("dataloader"), "async": snapshot}
                save_checkpoint(job, step, metrics | timings, extra=extra)
        settle_checkpoint(job)
        validating = validation_due(job.rollout, step, last)
        if step % cfg.async_training.sync_every == 0 or validating:
            with timer("sync", timings):
                metrics |= _push(job, producer, step)
        if validating:
            with timer("testing", timings):
                metrics |= evaluate(job.rollout, step)
    metrics |= step_metrics(job.training, batch, timings, job.num_devices)
    metrics |= staleness_metrics(batch["rollout_versions"], step - 1, ages=taken_ages(groups))
    metrics["async/trainer_idle_s"] = timings["timing/wait_rollout"]
    metrics["async/engine_idle_s"] = producer.take_engine_idle_seconds()
    metrics["async/samples_per_s"] = len(batch) / timings["timing/step"]
    return metrics


def _take_fresh(
    job: Job, producer: RolloutProducer, buffer: GroupBuffer, step: int
) -> tuple[list[Group], dict[str, float]]:
    """`train_batch_size` groups whose every sample is at most `max_staleness` behind v<step − 1>, in stream
    order; older ones are recycled or dropped (`stale_policy`), and counted."""
    cfg, need = job.cfg.async_training, job.cfg.data.train_batch_size
    fresh: list[Group] = []
    counts = {"async/buffer_depth": float(len(buffer)), "async/recycled_groups": 0.0, "async/dropped_groups": 0.0}
    while len(fresh) < need:
        taken = buffer.take(need - len(fresh), timeout=TAKE_POLL_S)
        if taken is None:
            producer.check()
            if producer.exhausted() and len(buffer) < need - len(fresh):
                raise RuntimeError(
                    f"step {step} needs {need - len(fresh)} more group(s) but the producer has started every group of "
                    f"the run's {job.total_steps} steps and none is in flight or owed: groups were lost"
                )
            continue
        for group in taken:
            if int(group.age_at(step - 1).max()) <= cfg.max_staleness:
                fresh.append(group)
            elif cfg.stale_policy == "recycle":
                producer.recycle(group.source)
                counts["async/recycled_groups"] += 1
            else:
                counts["async/dropped_groups"] += 1
    return sorted(fresh, key=lambda group: group.source.index), counts


def _push(job: Job, producer: RolloutProducer, step: int) -> dict[str, float]:
    """v<step> into the engines across in-flight requests: engines that died restart, pause (`pause_mode`),
    update, continue."""
    engines = job.rollout.engines
    job.rollout.recovery.before_pause()
    engines.wait(engines.pause(job.cfg.async_training.pause_mode))
    try:
        metrics = to_rollout(job, step, readmit=False)
    finally:
        engines.wait(engines.unpause())
    metrics |= job.rollout.recovery.after_sync()  # restarted replicas rejoin once their peers answer health again
    producer.advance(step)
    return metrics
