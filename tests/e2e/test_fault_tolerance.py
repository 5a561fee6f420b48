"""Engine failures, end to end on the CPU demo: an engine SIGKILLed while asleep, one SIGSTOPped (hung) while
generating and one SIGKILLed inside the hand-over (while the trainer wakes the engines) come back, take the current
weights and serve again (the asleep ones restarted only once the trainer left the devices). A SIGKILLed actor rank
restarts the whole run: tests/e2e/test_trainer_e2e.py. An engine killed in a fully asynchronous run:
tests/e2e/test_async_training.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megarl.data.arith import write_parquet

REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("megarl-train")


@pytest.fixture(scope="module")
def arith_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("arith")
    write_parquet(root / "train.parquet", num_rows=64, seed=0, split="train")
    return f"data.train_files=[{root}/train.parquet]"


def _env() -> dict[str, str]:
    """The repository first on the path: the installed `megarl-train` would otherwise import the checkout it was
    installed from (another worktree's driver beside this one's Ray workers, which start in the cwd)."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": path}


def _engine_pid(port: int) -> int:
    """The embedded engine serving `port` (its command line names the port)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megarl.engines.embedded" in argv and str(port).encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no embedded engine on port {port}")


def _released(url: str, run_dir: Path) -> list[str] | None:
    """What the engine at `url` released (["kv_cache", "weights"]: asleep, the trainer holds the devices), None if it
    does not answer; asked with the run's API key (`<run_dir>/engine_keys.json`)."""
    try:
        key = json.loads((run_dir / "engine_keys.json").read_text())["api_key"]
        request = urllib.request.Request(f"{url}/server_info", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.load(reply)["released"]
    except OSError:
        return None


ASLEEP = ["kv_cache", "weights"]


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _demo(run_dir: Path, data: str, *extra: str) -> list[str]:
    """`megarl-train` on the CPU demo (two embedded engines, actor TP=2), no validation."""
    common = ["trainer.test_freq=0", "trainer.progress_bar=false", "trainer.logger=[console]", "data.val_files=[]"]
    return [
        str(EXE),
        "--config-name",
        "demo_cpu",
        "model=tiny_dense",
        "trainer.val_before_train=false",
        f"trainer.run_dir={run_dir}",
        data,
        *common,
        *extra,
    ]


def _steps(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_killed_and_a_hung_engine_come_back_and_the_run_finishes(arith_data: str, tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    command = _demo(run_dir, arith_data, "trainer.total_training_steps=5", "trainer.save_freq=0")
    # 15 s: the hung engine is found by its requests timing out; a healthy one on a loaded machine answers in time
    command += ["rollout.request_timeout_s=15", "trainer.max_restarts=0"]  # engines recover in place, not the run
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: re.search(r"replica\(s\) on .* at (\S+), (\S+)", log.read_text()), proc, "engine URLs")
        urls = re.search(r"replica\(s\) on .* at (\S+), (\S+)", log.read_text()).groups()  # type: ignore[union-attr]
        ports = [int(url.rsplit(":", 1)[1]) for url in urls]
        _wait_for(lambda: len(_steps(run_dir)) >= 1, proc, "step 1")
        # killed asleep in step 2: its restart comes before the sync
        _wait_for(lambda: _released(urls[0], run_dir) == ASLEEP, proc, "engine 0 asleep in step 2")
        os.kill(_engine_pid(ports[0]), signal.SIGKILL)
        _wait_for(lambda: len(_steps(run_dir)) >= 3, proc, "step 3")
        os.kill(_engine_pid(ports[1]), signal.SIGSTOP)
        _wait_for(lambda: len(_steps(run_dir)) >= 4, proc, "step 4")
        # killed inside step 5's hand-over: stopped asleep, so the trainer's call to wake its weights waits on it
        # while engine 1 wakes its own; then killed, which fails that call
        _wait_for(lambda: _released(urls[0], run_dir) == ASLEEP, proc, "engine 0 asleep in step 5")
        os.kill(_engine_pid(ports[0]), signal.SIGSTOP)
        _wait_for(lambda: _released(urls[1], run_dir) == ["kv_cache"], proc, "engine 1's weights awake in step 5")
        os.kill(_engine_pid(ports[0]), signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    records = _steps(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["engines/restarts"] == 3.0
    assert [r["engines/handovers_again"] for r in records] == [0, 0, 0, 0, 1]  # step 5's sync ran again
    # the engines killed asleep restarted once the actor had left the devices to them
    assert [r["engines/trainer_bytes_at_restart"] for r in records if "engines/trainer_bytes_at_restart" in r] == [0, 0]
    assert all(r["handover/reserved_before_bytes"] == r["handover/reserved_after_bytes"] == 0 for r in records)
    readmitted = [r for r in records if "engines/live_replicas" in r]
    assert [int(r["step"]) for r in readmitted] == [2, 4, 5]
    assert all(r["engines/live_replicas"] == 2.0 for r in readmitted)
    assert readmitted[-1]["engines/retried_requests"] > 0  # the hung engine's requests timed out and moved
    for record in records:  # after each restart the engine's log-probs are the trainer's again
        assert record["rollout_gap/abs_diff/max"] <= 1e-4, record["step"]
