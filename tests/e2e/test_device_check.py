"""The GPU check's kit, rehearsed on CPU: the carried wheels fit the budget, and with them megarl imports
under the GPU machine's Python 3.12, torch 2.11 and transformers 5.17 (`device_check.sh --dry`, steps
install and imports; the full dry run is README's "GPU check")."""

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_carried_wheels_fit_and_megarl_imports_under_the_gpu_machines_stack(tmp_path: Path) -> None:
    wheels = subprocess.run(["bash", "tools/gpu_wheels.sh"], cwd=REPO, capture_output=True, text=True, check=False)
    assert wheels.returncode == 0, wheels.stdout[-3000:] + wheels.stderr[-3000:]
    assert "of the 64 MiB budget" in wheels.stdout
    (ray,) = (REPO / ".whl").glob("ray-*.whl")
    assert not [name for name in zipfile.ZipFile(ray).namelist() if name.startswith(("ray/jars/", "ray/rllib/"))]
    check = subprocess.run(
        ["bash", "tests/gpu/device_check.sh", "--dry", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "STEPS": "install env imports"},
    )
    summary = (tmp_path / "summary.md").read_text()
    assert check.returncode == 0, summary + check.stdout[-3000:]
    assert "every step passed" in summary
    log = (tmp_path / "log.txt").read_text()
    imported = next(line for line in log.splitlines() if line.startswith("imported "))
    count, total = imported.split()[1], imported.split()[3]
    assert count == total and int(total) > 150
    env = (tmp_path / "env.txt").read_text()
    assert "\n3.12." in env and "torch 2.11.0" in env and "transformers 5.17.0" in env
