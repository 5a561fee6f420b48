"""Restarts without a human (megarl.trainer.restarts) and the asynchronous save's commit (CheckpointManager.start /
finish): attempts that fail with the errors the workers raise, checkpoints written by the manager itself."""

import json
from pathlib import Path

import pytest
from conftest import compose_config
from ray.exceptions import RayActorError

from megarl.engines.replicas.supervisor import EngineLost
from megarl.trainer.checkpoint import CheckpointError, CheckpointManager
from megarl.trainer.restarts import RESTARTS_FILE, retriable, run_with_restarts
from megarl.workers.base import GuardStop
from megarl.workers.group import RankFailure


def _config(run_dir: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return compose_config(f"trainer.run_dir={run_dir}", "trainer.resume_mode=disable", *overrides)


class Attempts:
    """Fails with `errors` in turn, then finishes; records each attempt's resume_mode."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.resume_modes: list[str] = []

    def __call__(self, cfg) -> BaseException | None:  # type: ignore[no-untyped-def]
        self.resume_modes.append(cfg.trainer.resume_mode)
        return self.errors.pop(0) if self.errors else None


def _checkpoint(run_dir: Path, step: int) -> None:
    manager = CheckpointManager(run_dir / "checkpoints")
    manager.save(step, lambda staging: [], {})


def test_failures_restart_with_doubling_backoff_from_the_latest_checkpoint(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "trainer.max_restarts=2", "trainer.restart_backoff_s=5")
    first = RankFailure("actor rank 1 (Ray actor megarl-actor-1 on node 10.0.0.2) died in update_policy:\n  tail")
    attempts, slept = Attempts(first, EngineLost("replica 0 failed 4 times")), []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:  # the second attempt wrote a checkpoint before it failed
            _checkpoint(tmp_path, 3)

    assert run_with_restarts(cfg, attempts, sleep) is None
    assert slept == [5.0, 10.0]
    # before the run had a checkpoint the restart starts as the first attempt did; then it resumes
    assert attempts.resume_modes == ["disable", "disable", "auto"]
    records = [json.loads(line) for line in (tmp_path / RESTARTS_FILE).read_text().splitlines()]
    assert [(r["restart"], r["of"], r["delay_s"]) for r in records] == [(1, 2, 5.0), (2, 2, 10.0)]
    assert records[0]["cause"] == str(first)


def test_exceeding_max_restarts_stops_listing_every_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "trainer.max_restarts=1", "trainer.restart_backoff_s=0")
    errors = (RankFailure("actor rank 0 died in update_policy:\n  trace"), RayActorError())
    causes = run_with_restarts(cfg, Attempts(*errors, RankFailure("never reached")), lambda s: None)
    assert causes == ["actor rank 0 died in update_policy:", str(errors[1]).strip().splitlines()[0]]
    err = capsys.readouterr().err
    assert "restart 1/1 in 0 s from the latest checkpoint (trainer.max_restarts) after: actor rank 0 died" in err
    assert "failed 2 time(s), more than trainer.max_restarts=1 allows" in err
    assert "  1. actor rank 0 died in update_policy:\n  2. " in err
    assert len((tmp_path / RESTARTS_FILE).read_text().splitlines()) == 1  # the second failure was not restarted


def test_zero_restarts_stops_at_the_first_failure(tmp_path: Path) -> None:
    attempts = Attempts(RankFailure("critic rank 0 raised in update_critic"))
    assert run_with_restarts(_config(tmp_path, "trainer.max_restarts=0"), attempts, lambda s: None) == [
        "critic rank 0 raised in update_critic"
    ]
    assert attempts.resume_modes == ["disable"]


def test_an_async_save_is_committed_only_once_written_and_exported(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, lambda staging: [], {"n": 1})

    def stage_actor(staging: Path) -> list[OSError | None]:
        (staging / "actor").mkdir()
        return [None]

    assert manager.start(2, stage_actor, {"n": 2}, "stop")
    written, exported = [False], []
    export = exported.append
    manager.finish(lambda: written[0], export, blocking=False)
    assert manager.latest() == tmp_path / "global_step_1" and exported == []  # the writers are still at work
    written[0] = True
    manager.finish(lambda: written[0], export, blocking=True)
    assert exported == [tmp_path / ".global_step_2.partial"]  # exported from staging, before the commit
    assert manager.latest() == tmp_path / "global_step_2" and manager.pending is None
    assert (tmp_path / "global_step_2" / "actor").is_dir()


def test_a_failed_async_write_keeps_latest_and_stops(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, lambda staging: [], {})
    manager.start(2, lambda staging: [None], {}, "stop")

    def written() -> bool:
        raise OSError(28, "No space left on device", str(tmp_path / ".global_step_2.partial"))

    with pytest.raises(CheckpointError, match="step 2 .* ENOSPC .* `latest` names global_step_1"):
        manager.finish(written, None, blocking=True)
    assert manager.pending is None and not (tmp_path / ".global_step_2.partial").exists()
    assert manager.latest() == tmp_path / "global_step_1"


def test_what_is_retried() -> None:
    assert retriable(RankFailure("actor rank 0 died in update_policy"))
    assert retriable(EngineLost("replica 0 failed 4 times")) and retriable(RayActorError())
    assert not retriable(RankFailure("actor rank 0 raised in update_policy: GuardStop", retriable=False))
    assert not retriable(GuardStop("the actor skipped 3 optimizer steps")) and not retriable(ValueError("bad"))
    assert not retriable(CheckpointError("could not save the checkpoint of step 2"))
