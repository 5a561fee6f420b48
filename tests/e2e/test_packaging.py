"""Installability: the `gpu` extra resolves with pip together with the `te` extra's TransformerEngine (metadata only:
nothing is downloaded beyond it), and the CPU constraints keep the versions the suite runs with."""

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _resolve(*specs: str) -> dict[str, dict]:
    """Name → metadata (version, requires_dist) of everything pip would install for `specs` into an empty
    environment."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    done = subprocess.run(
        [*command, "--report", "-", *specs], cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}


TE_CORE = "transformer-engine[core_cu13]>=2.9,<2.12"
"""The `te` extra without its `pytorch` extra: that one's package (transformer_engine_torch) ships as an sdist whose
metadata pip can only get by building it, which downloads torch into an isolated build environment (minutes of CI);
its pin is read from transformer-engine's own metadata instead."""


@pytest.mark.slow
def test_gpu_extra_resolves_with_sglangs_pins() -> None:
    resolved = _resolve(".[gpu]", TE_CORE)
    assert resolved["sglang"]["version"] == "0.5.23"
    assert resolved["torch"]["version"] == "2.14.1" and resolved["transformers"]["version"] == "5.19.0"
    assert resolved["megatron-core"]["version"] == "0.16.1"
    engine = resolved["transformer-engine"]
    assert Version("2.9") <= Version(engine["version"]) < Version("2.12")
    assert resolved["transformer-engine-cu13"]["version"] == engine["version"]
    pins = [req for req in engine["requires_dist"] if req.startswith("transformer_engine_torch")]
    assert pins == [f'transformer_engine_torch=={engine["version"]}; extra == "pytorch"'], pins
    te_extra = TE_CORE.replace("[core_cu13]", "[core_cu13,pytorch]")
    assert f'"te": ["{te_extra}"]' in (ROOT / "setup.py").read_text()  # what was resolved is the extra, less pytorch


def test_cpu_set_up_runs_the_constrained_versions() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "launch" / "constraints-cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins == {"torch": "2.13.0", "transformers": "5.23.0"}
    assert version("torch").split("+")[0] == pins["torch"] and version("transformers") == pins["transformers"]
