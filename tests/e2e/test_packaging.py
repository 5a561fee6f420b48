"""Installability: the `gpu` and `te` extras resolve with pip (metadata only: nothing is downloaded beyond it), and
the CPU constraints keep the versions the suite runs with."""

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _resolve(spec: str) -> dict[str, str]:
    """Name → version of everything pip would install for `spec` into an empty environment."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    done = subprocess.run(
        [*command, "--report", "-", spec], cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


@pytest.mark.slow
def test_gpu_extra_resolves_with_sglangs_pins() -> None:
    resolved = _resolve(".[gpu,te]")
    assert resolved["sglang"] == "0.5.23"
    assert resolved["torch"] == "2.14.1" and resolved["transformers"] == "5.19.0"
    assert resolved["megatron-core"] == "0.16.1"
    engine = Version(resolved["transformer-engine"])
    assert Version("2.9") <= engine < Version("2.12")
    assert resolved["transformer-engine-torch"] == resolved["transformer-engine-cu13"] == str(engine)


def test_cpu_set_up_runs_the_constrained_versions() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "launch" / "constraints-cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins == {"torch": "2.13.0", "transformers": "5.23.0"}
    assert version("torch").split("+")[0] == pins["torch"] and version("transformers") == pins["transformers"]
