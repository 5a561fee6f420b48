"""The bounded hand-off between the rollout producer and the trainer in fully asynchronous training.

A `Group` is one prompt's `rollout.n` finished, scored trajectories, numbered by its place in the
prompt stream. The producer `put`s groups as they finish; the trainer `take`s the lowest-numbered
ones (so with max_staleness=0 a step trains the rows the synchronous trainer would, in its order).

    buffer = GroupBuffer()
    buffer.put(group)                      # producer thread
    groups = buffer.take(4, timeout=1.0)   # trainer: waits until 4 are here (None: closed, or timed out)

Back-pressure is the producer's: it starts a group only while in-flight + `len(buffer)` stay under
the capacity (`RolloutProducer`). `take` waits on a condition that `put` and `close` notify.
"""

import threading
from dataclasses import dataclass, field

import torch

from megarl.batch import Batch
from megarl.rewards.score import Scored
from megarl.trainer.drivers.staleness import staleness


@dataclass(frozen=True, slots=True)
class PromptGroup:
    """A prompt to roll out `rollout.n` times, with what makes its samples reproducible."""

    index: int
    """Place in the prompt stream (0, 1, …): the k-th prompt ever drawn, over all epochs."""
    prompt: Batch
    """The prompt row (one row of the loader's batch)."""
    uid: str
    """The uid the synchronous trainer gives this prompt (`<step>.<round>:<row>`)."""
    seed: int
    """The rollout seed of the synchronous trainer's step that would have drawn this prompt."""
    first_row: int
    """Sample rows of this prompt in that step's rollout batch start here (row seeds are seed + 1000 × row)."""


@dataclass(slots=True)
class Group:
    source: PromptGroup
    batch: Batch
    """[n rows] rollout columns, the prompt's columns and `uid`."""
    scored: Scored
    attempts: int = 1
    """Times this prompt was rolled out (recycled groups roll out again)."""
    ages: torch.Tensor | None = None
    """[n] each row's staleness when the trainer took the group (`age_at`); None before."""

    def age_at(self, current: int) -> torch.Tensor:
        """[n] each row's staleness against trainer version `current`, computed once here and kept in `ages`: the
        freshness check and the step's `staleness_metrics` both read it."""
        self.ages = staleness(self.batch["rollout_versions"], current)
        return self.ages


def taken_ages(groups: list[Group]) -> torch.Tensor:
    """[sum of n] the `ages` of groups the trainer took (`age_at`), in their order: the concatenated batch's rows."""
    ages = [group.ages for group in groups]
    assert all(age is not None for age in ages), "every group's age_at ran when it was taken"
    return torch.cat([age for age in ages if age is not None])


@dataclass(slots=True)
class GroupBuffer:
    _groups: dict[int, Group] = field(default_factory=dict)
    _ready: threading.Condition = field(default_factory=threading.Condition)
    _closed: bool = False

    def __len__(self) -> int:
        with self._ready:
            return len(self._groups)

    def put(self, group: Group) -> None:
        with self._ready:
            assert group.source.index not in self._groups, f"group {group.source.index} is buffered twice"
            self._groups[group.source.index] = group
            self._ready.notify_all()

    def take(self, count: int, timeout: float | None = None) -> list[Group] | None:
        """The `count` lowest-numbered groups once that many are here, in stream order; None once closed, or
        when `timeout` seconds pass first."""
        with self._ready:
            self._ready.wait_for(lambda: self._closed or len(self._groups) >= count, timeout)
            if self._closed or len(self._groups) < count:
                return None
            return [self._groups.pop(index) for index in sorted(self._groups)[:count]]

    def close(self) -> None:
        """Wake and end every `take` (shutdown, or the producer failed)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def snapshot(self) -> list[PromptGroup]:
        """The buffered groups' prompts (a checkpoint rolls them out again on resume)."""
        with self._ready:
            return [self._groups[index].source for index in sorted(self._groups)]
