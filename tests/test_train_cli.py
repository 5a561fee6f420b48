"""`megarl-train` end to end in this version: compose, validate, write the config, load data."""

import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO


def test_demo_config_prepares_a_run(data_overrides: list[str], tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("megarl-train")
    out = subprocess.run(
        [str(exe), "--config-name", "demo_cpu", f"trainer.run_dir={tmp_path}", *data_overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    log = out.stdout + out.stderr
    assert "40 training prompts (0 over-long dropped), 5 steps/epoch, 5 steps planned" in log
    assert "validation: 40 prompts (0 over-long dropped)" in log
    assert "actor: 8 prompts × n=4 = 32 trajectories/step → 2 mini-batch(es) of 16 over DP=1 = 16 per DP rank" in log
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["experiment_name"] == "demo_cpu"
    assert saved["actor"]["megatron"]["tensor_model_parallel_size"] == 2
    assert saved["model"]["path"].endswith("models/tiny_dense")
