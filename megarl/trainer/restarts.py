"""Restarts without a human (`trainer.max_restarts`): a run whose rank or engine failed starts again from its latest
committed checkpoint after a doubling back-off, until the bound; what is not worth retrying stops at once.

Retried: `RankFailure` (a rank died, raised or hung; not when it stopped the run on purpose, `GuardStop`),
`EngineLost` (engines failed more often than their own restart bounds allow) and any other Ray error (an actor or
object lost with its node). Not retried: every other exception, among them `DataError`, `ConfigError`,
`RunStopped` and `GuardStop` (the divergence guards) and `CheckpointError` (disk full, permission denied): a
restart would meet them again. Each restart is logged on stderr and appended to `<run_dir>/restarts.jsonl` (time,
attempt, cause); when the bound is exceeded the run stops listing every cause.
"""

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ray.exceptions import RayError

from megarl.config.root import MegarlConfig
from megarl.engines.replicas.supervisor import EngineLost
from megarl.trainer.checkpoint import CheckpointManager
from megarl.workers.group import RankFailure

RETRIABLE: tuple[type[BaseException], ...] = (RankFailure, EngineLost, RayError)
"""What a fresh start from the latest checkpoint may get past (`retriable` tells the exceptions among them)."""


def retriable(err: BaseException) -> bool:
    """Whether a restart may get past `err`: a `RETRIABLE` error, unless a rank stopped the run on purpose (a
    divergence guard, `GuardStop`)."""
    return isinstance(err, RETRIABLE) and getattr(err, "retriable", True)


RESTARTS_FILE = "restarts.jsonl"


def first_line(err: BaseException) -> str:
    """The exception's first line (a rank failure's message goes on with the rank's traceback and log)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(kw_only=True, slots=True)
class Restarts:
    """The restart budget of one `megarl-train` invocation and the causes of the restarts so far."""

    limit: int
    backoff_s: float
    run_dir: Path
    causes: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: MegarlConfig) -> "Restarts":
        t = cfg.trainer
        return cls(limit=t.max_restarts, backoff_s=t.restart_backoff_s, run_dir=Path(t.run_dir))

    def after(self, err: BaseException) -> float | None:
        """Record `err` as the cause of a failed attempt; the seconds to wait before the next one, or None when that
        would exceed `limit` (the run stops)."""
        self.causes.append(first_line(err))
        attempt = len(self.causes)
        if attempt > self.limit:
            return None
        delay = self.backoff_s * 2 ** (attempt - 1)
        record = {"time": time.time(), "restart": attempt, "of": self.limit, "delay_s": delay, "cause": str(err)}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / RESTARTS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        return delay

    def announce(self, delay: float) -> str:
        """The line logged before a restart."""
        return (
            f"restart {len(self.causes)}/{self.limit} in {delay:g} s from the latest checkpoint "
            f"(trainer.max_restarts) after: {self.causes[-1]}"
        )

    def give_up(self) -> str:
        """The message the run stops with once the bound is exceeded: every cause, oldest first."""
        lines = "\n".join(f"  {i}. {cause}" for i, cause in enumerate(self.causes, 1))
        return (
            f"the run failed {len(self.causes)} time(s), more than trainer.max_restarts={self.limit} allows; "
            f"the causes, oldest first:\n{lines}"
        )


def resumable(cfg: MegarlConfig) -> MegarlConfig:
    """The config of a restart: it resumes from the run's latest checkpoint once the run has one (whatever
    trainer.resume_mode said); before that, it starts as the first attempt did."""
    if CheckpointManager.latest_in(Path(cfg.trainer.run_dir) / "checkpoints") is None:
        return cfg
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode="auto"))


def run_with_restarts(
    cfg: MegarlConfig,
    attempt: Callable[[MegarlConfig], BaseException | None],
    sleep: Callable[[float], None] = time.sleep,
) -> list[str] | None:
    """`attempt(cfg)` until it returns None (the run finished): after each retriable error it returns, wait the
    back-off and go again from the run's latest checkpoint. Returns None once finished, or every cause when the bound
    was exceeded (after logging why on stderr)."""
    restarts = Restarts.from_config(cfg)
    while (failure := attempt(cfg)) is not None:
        delay = restarts.after(failure)
        if delay is None:
            print(f"megarl-train: {restarts.give_up()}", file=sys.stderr)
            return restarts.causes
        print(f"megarl-train: {restarts.announce(delay)}", file=sys.stderr)
        sleep(delay)
        cfg = resumable(cfg)
    return None
