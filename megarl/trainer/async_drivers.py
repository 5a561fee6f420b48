"""The asynchronous drivers beside `Trainer.fit` (`async_training.mode`; docs/async.md).

Both need `trainer.placement=separate`: the engines keep their own devices while the trainer updates, so an
engine restarted before a push (`Trainer.to_rollout` → `EngineRecovery.before_rollout`) loads beside no trainer
memory; only the colocated `fit` has to vacate the devices first.
Weight versions are step numbers: the engines serve "v<k>" after the push of step k's weights, and the
trainer's current version at step s is s − 1 (`megarl.trainer.staleness`).

- `one_step_off`: step s trains the batch rolled out while step s − 1 trained (by v<s−2>); the weights
  move between steps while the engines are idle, so every sample is exactly one version old and no
  rollout crosses an update.
- `fully_async`: a `RolloutProducer` thread keeps groups in flight; each step takes `train_batch_size`
  finished groups no older than `max_staleness` from a `GroupBuffer`, and every `sync_every` steps the
  weights are pushed across in-flight requests (pause in `pause_mode`, update, continue).
"""

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from megarl.agents.manager import rollout_metrics
from megarl.batch import Batch
from megarl.rewards.score import Scored
from megarl.trainer.driver import Trainer
from megarl.trainer.group_buffer import Group, GroupBuffer
from megarl.trainer.metrics import timer
from megarl.trainer.producer import RolloutProducer
from megarl.trainer.staleness import staleness, staleness_metrics
from megarl.trainer.tracking import ProgressBar

logger = logging.getLogger("megarl")
TAKE_POLL_S = 1.0
"""How often a waiting step checks that the producer can still deliver its groups."""


def one_step_off(trainer: Trainer) -> None:
    """Train `total_steps` steps, each on the rollout that ran during the previous step.

    Consumes: the prompt stream, one step ahead. Waits for: the rollout of the step about to train.
    Shuts down: the last step starts no rollout; the executor ends with the loop. A checkpoint saves the
    loader position from before the in-flight rollout drew its prompts, so a resume rolls them out again.
    """
    step, bar = _begin(trainer)
    engine_version = step
    executor = ThreadPoolExecutor(1, thread_name_prefix="megarl-next-rollout")
    before, pending = _launch(executor, trainer, step + 1)
    while step < trainer.total_steps:
        step += 1
        last = step == trainer.total_steps
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timings):
            with timer("wait_rollout", timings):
                batch, scores, gen_metrics = pending.result()
            if engine_version < step - 1:
                with timer("sync", timings):
                    metrics |= trainer.to_rollout(step - 1)  # the engines are idle: nothing in flight
                engine_version = step - 1
            if not last:
                before, pending = _launch(executor, trainer, step + 1)
            metrics |= gen_metrics | trainer.train_on(batch, scores, step, timings)
            if trainer.due(trainer.cfg.trainer.save_freq, step, last):
                with timer("save_checkpoint", timings):
                    trainer.save_checkpoint(step, metrics | timings, extra={"dataloader": before})
            if trainer.validation_due(step, last):
                pending.result()  # validation evaluates v<step>: push it once the next rollout is done
                with timer("testing", timings):
                    metrics |= trainer.to_rollout(step) | trainer.validate(step)
                engine_version = step
        metrics |= trainer.step_metrics(batch, timings) | staleness_metrics(batch["rollout_versions"], step - 1)
        trainer.tracker.log(metrics, step)
        bar.update(step, metrics)
    executor.shutdown()
    bar.close()
    trainer.finish()


def _launch(executor: ThreadPoolExecutor, trainer: Trainer, step: int) -> tuple[dict[str, int], Future]:
    """The loader position before step `step`'s rollout draws its prompts, and that rollout, started."""
    assert trainer.loader is not None
    return trainer.loader.state_dict(), executor.submit(trainer.collect, step)


def fully_async(trainer: Trainer) -> None:
    """Train `total_steps` steps on groups a producer rolls out continuously (module docstring).

    Consumes: finished groups from the buffer. Waits for: `train_batch_size` fresh ones. Shuts down: after
    the last step, or on any error, the producer is stopped (it cancels what is in flight; a checkpoint
    already lists those prompts) and its own error, if any, is raised.
    """
    step, bar = _begin(trainer)
    buffer = GroupBuffer()
    resumed = trainer.resumed_state.get("async")
    if resumed is not None:
        logger.info(
            "async: resuming with %d drawn prompt group(s) to roll out again, then stream index %d",
            len(resumed["owed"]),
            resumed["next_index"],
        )
    producer = RolloutProducer(trainer, buffer, engine_version=step, resumed=resumed)
    producer.start()
    try:
        while step < trainer.total_steps:
            step += 1
            metrics = _async_step(trainer, producer, buffer, step)
            trainer.tracker.log(metrics, step)
            bar.update(step, metrics)
    finally:
        producer.stop()
    bar.close()
    trainer.finish()


def _async_step(trainer: Trainer, producer: RolloutProducer, buffer: GroupBuffer, step: int) -> dict[str, float]:
    cfg, last = trainer.cfg, step == trainer.total_steps
    timings: dict[str, float] = {}
    with timer("step", timings):
        with timer("wait_rollout", timings):
            groups, metrics = _take_fresh(trainer, producer, buffer, step)
        batch = Batch.concat([group.batch for group in groups])
        metrics |= rollout_metrics(batch) | trainer.train_on(batch, _done(Scored.concat(groups)), step, timings)
        if trainer.due(cfg.trainer.save_freq, step, last):
            with timer("save_checkpoint", timings):
                snapshot = producer.snapshot()
                extra = {"dataloader": snapshot.pop("dataloader"), "async": snapshot}
                trainer.save_checkpoint(step, metrics | timings, extra=extra)
        validate = trainer.validation_due(step, last)
        if step % cfg.async_training.sync_every == 0 or validate:
            with timer("sync", timings):
                metrics |= _push(trainer, producer, step)
        if validate:
            with timer("testing", timings):
                metrics |= trainer.validate(step)
    metrics |= trainer.step_metrics(batch, timings) | staleness_metrics(batch["rollout_versions"], step - 1)
    metrics["async/trainer_idle_s"] = timings["timing/wait_rollout"]
    metrics["async/engine_idle_s"] = producer.take_engine_idle_seconds()
    metrics["async/samples_per_s"] = len(batch) / timings["timing/step"]
    return metrics


def _take_fresh(
    trainer: Trainer, producer: RolloutProducer, buffer: GroupBuffer, step: int
) -> tuple[list[Group], dict[str, float]]:
    """`train_batch_size` groups whose every sample is at most `max_staleness` behind v<step − 1>, in stream
    order; older ones are recycled or dropped (`stale_policy`), and counted."""
    cfg, need = trainer.cfg.async_training, trainer.cfg.data.train_batch_size
    fresh: list[Group] = []
    counts = {"async/buffer_depth": float(len(buffer)), "async/recycled_groups": 0.0, "async/dropped_groups": 0.0}
    while len(fresh) < need:
        taken = buffer.take(need - len(fresh), timeout=TAKE_POLL_S)
        if taken is None:
            producer.check()
            if producer.exhausted() and len(buffer) < need - len(fresh):
                raise RuntimeError(
                    f"step {step} needs {need - len(fresh)} more group(s) but the producer has started every group of "
                    f"the run's {trainer.total_steps} steps and none is in flight or owed: groups were lost"
                )
            continue
        for group in taken:
            if int(staleness(group.batch["rollout_versions"], step - 1).max()) <= cfg.max_staleness:
                fresh.append(group)
            elif cfg.stale_policy == "recycle":
                producer.recycle(group.source)
                counts["async/recycled_groups"] += 1
            else:
                counts["async/dropped_groups"] += 1
    return sorted(fresh, key=lambda group: group.source.index), counts


def _push(trainer: Trainer, producer: RolloutProducer, step: int) -> dict[str, float]:
    """v<step> into the engines across in-flight requests: pause (`pause_mode`), update, continue."""
    engines = trainer.engines
    assert engines is not None
    engines.wait(engines.pause(trainer.cfg.async_training.pause_mode))
    try:
        metrics = trainer.to_rollout(step)
    finally:
        engines.wait(engines.unpause())
    producer.advance(step)
    return metrics


def _begin(trainer: Trainer) -> tuple[int, ProgressBar]:
    """Resume, push the weights the engines should serve first, validate before training when asked."""
    step = trainer.resume()
    trainer.to_rollout(step)
    if trainer.cfg.trainer.val_before_train and step == 0 and trainer.val_loader is not None:
        trainer.tracker.log(trainer.validate(step), step)
    return step, ProgressBar(trainer.total_steps, step, disable=not trainer.cfg.trainer.progress_bar)


def _done(scored: Scored) -> "Future[Scored]":
    done: Future[Scored] = Future()
    done.set_result(scored)
    return done
