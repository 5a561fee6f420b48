"""`RolloutProducer`: a driver thread that keeps prompt groups rolling out and buffers the finished ones.

    producer = RolloutProducer(job, buffer, engine_version=step, resumed=state)
    producer.start()
    ... buffer.take(...) ...; producer.recycle(group.source); producer.advance(new_version)
    producer.stop()

Consumes: prompt groups, the ones to roll out again (recycled, or owed by a resumed checkpoint) first,
in stream order, then new ones drawn from the job's prompt stream one loader batch at a time.
Admits a new group only while (1) fewer than `in_flight_limit` groups roll out, (2) in-flight plus
buffered groups stay under the buffer capacity (back-pressure), and (3) the synchronous step that
would have drawn it is at most `max_staleness` steps past the engines' version + 1, so no group
starts that could only be trained too stale (AReaL's admission rule), and (4) that step is not past the
run's last, so a run of T steps rolls out exactly the stream's first T × train_batch_size prompts
(plus the recycled ones again), whatever order they finish in.
Waits for: `ray.wait` on the in-flight rollouts, at most `POLL_S` at a time.
Unblocked by: a rollout finishing; the trainer taking groups; `advance()` after a weight push.
Shuts down: `stop()` sets an event, the thread leaves at its next poll and cancels what is still in
flight (a checkpoint already lists those prompts: they are rolled out again on resume). An error in
the thread closes the buffer, so the trainer's `take` returns None, and `stop()`/`check()` re-raise it.
"""

import threading
import time
from typing import Any

import ray

from megarl.batch import Batch
from megarl.config.async_training import buffer_capacity, in_flight_limit
from megarl.rewards.score import Scored
from megarl.trainer import steps
from megarl.trainer.collect import round_seed
from megarl.trainer.drivers.group_buffer import Group, GroupBuffer, PromptGroup
from megarl.trainer.job import Job

POLL_S = 0.05
"""Longest wait on the in-flight rollouts before the admission rules are checked again."""


def admits(index: int, batch_size: int, engine_version: int, max_staleness: int) -> bool:
    """Whether new group `index` may start: the synchronous step that would draw it, index // batch_size + 1,
    is at most `max_staleness` past the step the engines' weights serve (engine_version + 1)."""
    return index // batch_size + 1 <= engine_version + 1 + max_staleness


def draw_groups(prompts: Batch, first_index: int, batch_size: int, n: int, seed: int) -> list[PromptGroup]:
    """One loader batch as groups numbered from stream index `first_index`, each with the uid, seed and sample rows
    the synchronous trainer's step `first_index // batch_size + 1` gives it in its first generation round
    (`collect.collect`: uid `<step>.1:<row>` as `steps.samples_of` builds it, `round_seed(seed, step, 1)`). The uid
    is built here only; `group_samples` puts it on the samples."""
    step = first_index // batch_size + 1
    step_seed = round_seed(seed, step, 1)
    return [
        PromptGroup(
            index=first_index + i, prompt=prompts[i : i + 1], uid=f"{step}.1:{i}", seed=step_seed, first_row=i * n
        )
        for i in range(len(prompts))
    ]


def group_samples(group: PromptGroup, n: int) -> Batch:
    """[n rows] the group's prompt `n` times, without the loader's padded tensors (`steps.GENERATION_TENSORS`: the
    rollout makes its own), each row with `group.uid`, set once (as `steps.samples_of` does for a whole batch)."""
    prompt = group.prompt
    prompt = prompt.select(tensor_keys=[key for key in prompt.tensor_keys if key not in steps.GENERATION_TENSORS])
    prompt.set("uid", [group.uid])
    return prompt.repeat(n, interleave=True)


class RolloutProducer:
    def __init__(
        self, job: Job, buffer: GroupBuffer, engine_version: int, resumed: dict[str, Any] | None = None
    ) -> None:
        cfg = job.cfg
        self.cfg = cfg
        self.prompts = job.prompts
        self.total_steps = job.total_steps
        self.rollout = job.rollout.manager
        self.buffer = buffer
        self.batch_size = cfg.data.train_batch_size
        self.capacity = buffer_capacity(cfg.async_training, self.batch_size)
        self.in_flight_limit = in_flight_limit(cfg.async_training, self.batch_size)
        self.max_staleness = cfg.async_training.max_staleness
        self.engine_version = engine_version
        self.owed: list[PromptGroup] = list(resumed["owed"]) if resumed else []
        """Groups to roll out before any new one, in stream order."""
        self.next_index = resumed["next_index"] if resumed else engine_version * self.batch_size
        """The stream index of the next new group; a run resumed from a synchronous checkpoint at step s starts
        at s × train_batch_size, the prompts `fit` had drawn."""
        self.in_flight: dict[Any, tuple[PromptGroup, Batch]] = {}
        """ray.ObjectRef of an agent worker's rollout → (its group, the sample rows sent)."""
        self.engine_idle_s = 0.0
        self.error: BaseException | None = None
        self._drawn: list[PromptGroup] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-producer", daemon=True)

    # ---- the trainer's side ----

    def start(self) -> None:
        self._thread.start()

    def advance(self, engine_version: int) -> None:
        """The engines now serve `engine_version` (after a weight push)."""
        with self._lock:
            self.engine_version = engine_version

    def recycle(self, group: PromptGroup) -> None:
        """Roll `group`'s prompt out again (it came back too stale)."""
        with self._lock:
            self.owed = sorted([*self.owed, group], key=lambda g: g.index)

    def take_engine_idle_seconds(self) -> float:
        """Seconds with nothing in flight since the last call."""
        with self._lock:
            seconds, self.engine_idle_s = self.engine_idle_s, 0.0
        return seconds

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint must roll out again: every drawn group not yet trained (owed, undrawn rows of the
        current loader batch, in flight, buffered), the next stream index and the loader position."""
        with self._lock:
            pending = [*self.owed, *self._drawn, *(group for group, _ in self.in_flight.values())]
            pending += self.buffer.snapshot()
            return {
                "owed": sorted(pending, key=lambda g: g.index),
                "next_index": self.next_index + len(self._drawn),
                "dataloader": self.prompts.loader.state_dict(),
            }

    def exhausted(self) -> bool:
        """Nothing in flight or owed, and every group of the run's steps started: no more groups will come."""
        with self._lock:
            started_all = self.next_index >= self.total_steps * self.batch_size and not self._drawn
            return started_all and not self.in_flight and not self.owed

    def check(self) -> None:
        """Re-raise the thread's error, if it failed."""
        if self.error is not None:
            raise RuntimeError("the rollout producer failed") from self.error

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.check()

    # ---- the thread ----

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._start_admitted()
                self._collect_finished()
        except BaseException as error:
            self.error = error
        finally:
            self.buffer.close()
            for ref in self.in_flight:
                ray.cancel(ref)

    def _start_admitted(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                group = self._next_group()
                if group is None:
                    return
                samples = group_samples(group, self.cfg.rollout.n)
                ref = self.rollout.submit(samples, seed=group.seed, first_row=group.first_row)
                self.in_flight[ref] = (group, samples)

    def _next_group(self) -> PromptGroup | None:
        """The next group to start under the admission rules (module docstring), or None (lock held)."""
        busy = len(self.in_flight)
        if busy >= self.in_flight_limit or busy + len(self.buffer) >= self.capacity:
            return None
        if self.owed:
            return self.owed.pop(0)
        past_the_run = self.next_index // self.batch_size + 1 > self.total_steps
        if past_the_run or not admits(self.next_index, self.batch_size, self.engine_version, self.max_staleness):
            return None
        if not self._drawn:
            self._draw()
        self.next_index += 1
        return self._drawn.pop(0)

    def _draw(self) -> None:
        """Split the next loader batch into groups numbered from `next_index` (`draw_groups`)."""
        self._drawn = draw_groups(
            self.prompts.next(), self.next_index, self.batch_size, self.cfg.rollout.n, self.cfg.trainer.seed
        )

    def _collect_finished(self) -> None:
        if not self.in_flight:
            time.sleep(POLL_S)
            with self._lock:
                self.engine_idle_s += POLL_S
            return
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=POLL_S)
        for ref in ready:
            out, _ = ray.get(ref)
            group, samples = self.in_flight[ref]
            batch = steps.with_rollout(samples, out)
            scored = Scored.of_rollout(batch)  # the agent worker scored each trajectory as it finished
            with self._lock:
                del self.in_flight[ref]
                self.buffer.put(Group(source=group, batch=batch, scored=scored))
