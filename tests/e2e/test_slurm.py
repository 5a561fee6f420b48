"""The launch scripts: they parse, pass shellcheck, and bring a two-node Ray cluster up and down.

The bring-up runs launch/slurm/megarl.sbatch as slurm would, with tests/cases/fake_slurm/{srun,scontrol}
first on PATH: each "node" is a `ray start --block` process on this machine, and the driver is
tests/cases/slurm_probe.py, which records what it sees.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

SCRIPTS = sorted(
    [
        *REPO.glob("launch/**/*.sh"),
        *REPO.glob("launch/**/*.sbatch"),
        *REPO.glob("tests/cases/fake_slurm/*"),
        *REPO.glob("tests/gpu/*.sh"),
        *REPO.glob("tools/*.sh"),
    ]
)
PORT = 6391
FAKE_SLURM = REPO / "tests/cases/fake_slurm"


def test_scripts_parse() -> None:
    assert len(SCRIPTS) >= 6
    for script in SCRIPTS:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    result = subprocess.run(
        [shellcheck, "-x", *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _ray_processes(port: int) -> list[str]:
    """Command lines of Ray daemons of the cluster whose GCS listens on `port`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ("raylet" in text or "gcs_server" in text) and str(port) in text:
            found.append(text)
    return found


def _sbatch(tmp_path: Path, nodes: str, *overrides: str, **env: str) -> subprocess.Popen:
    environ = {
        **os.environ,
        "PATH": f"{FAKE_SLURM}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_SLURM_NODES": nodes,
        "SLURM_JOB_NODELIST": "fake[0-9]",
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(REPO),
        "MEGARL_LOG_DIR": str(tmp_path / "logs"),
        "MEGARL_RAY_PORT": str(PORT),
        "MEGARL_RAY_NUM_CPUS": "1",
        "MEGARL_RAY_START_ARGS": "--object-store-memory=100000000",
        "MEGARL_RAY_WAIT_S": "90",
        "MEGARL_TRAIN_CMD": f"{sys.executable} {REPO / 'tests/cases/slurm_probe.py'}",
        "MEGARL_PYTHON": sys.executable,
        "PROBE_OUT": str(tmp_path / "probe.json"),
        **env,
    }
    return subprocess.Popen(
        ["bash", str(REPO / "launch/slurm/megarl.sbatch"), *overrides],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_bring_up_two_nodes(tmp_path: Path) -> None:
    job = _sbatch(tmp_path, "nodeA nodeB", "trainer.device=cpu", "rollout.n=4")
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, out + err
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["alive_nodes"] == 2
    assert probe["argv"] == ["trainer.device=cpu", "rollout.n=4", "trainer.nnodes=2"]
    assert probe["ray_address"].endswith(f":{PORT}")
    for node in ("nodeA", "nodeB"):
        log = (tmp_path / "logs" / f"ray-{node}.log").read_text()
        assert "received SIGTERM" in log, log[-2000:]
    assert "all 2 node(s) up" in out
    assert _ray_processes(PORT) == []


def test_nnodes_given_is_kept(tmp_path: Path) -> None:
    job = _sbatch(tmp_path, "nodeA", "trainer.nnodes=1", SLURM_GPUS_ON_NODE="4")
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, out + err
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["argv"] == ["trainer.nnodes=1", "trainer.devices_per_node=4"]
    assert probe["alive_nodes"] == 1


def test_missing_node_times_out_with_a_clear_error(tmp_path: Path) -> None:
    job = _sbatch(tmp_path, "nodeA deadB", MEGARL_RAY_WAIT_S="20")
    _, err = job.communicate(timeout=240)
    assert job.returncode != 0
    assert "only 1 of 2 nodes registered with the Ray head" in err
    assert "MEGARL_RAY_WAIT_S" in err
    assert not (tmp_path / "probe.json").exists()
    assert _ray_processes(PORT) == []


def test_cancel_stops_driver_and_nodes(tmp_path: Path) -> None:
    job = _sbatch(tmp_path, "nodeA nodeB", PROBE_SLEEP="300")
    deadline = time.monotonic() + 180
    while not (tmp_path / "probe.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(1)
    assert _ray_processes(PORT) != []
    job.send_signal(signal.SIGTERM)  # what scancel does to the batch script
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, out + err
    assert "stopping the driver and the cluster" in err
    assert _ray_processes(PORT) == []


def test_local_launcher(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "launch/local.sh"), "--cfg", "job", "trainer.device=cpu", "trainer.devices_per_node=3"],
        env={**os.environ, "MEGARL_LOG_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (log,) = tmp_path.glob("local-*.log")
    assert "devices_per_node: 3" in result.stdout
    assert log.read_text() == result.stdout.split("\n", 1)[1]


def test_outside_an_allocation_fails_clearly(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", str(REPO / "launch/slurm/megarl.sbatch")],
        cwd=REPO,
        env={**environ, "PATH": f"{FAKE_SLURM}:{environ['PATH']}", "MEGARL_LOG_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "SLURM_JOB_NODELIST" in result.stderr
    assert "no nodes in this allocation" in result.stderr
