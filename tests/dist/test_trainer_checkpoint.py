"""Trainer checkpoints: atomic commit, `latest` last, pruning, resume modes, and a killed run that resumes
to the same weights and data order as an uninterrupted one (tests/cases/ckpt_train_loop.py, 2 processes)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cases.megatron_cases import save_random_model

from megarl.megatron.weights import SafetensorsReader
from megarl.trainer.checkpoint import TRAINER_STATE_FILE, CheckpointManager, load_trainer_state

TESTS = Path(__file__).resolve().parents[1]


def _save(manager: CheckpointManager, step: int) -> Path:
    staging = manager.begin(step)
    (staging / "actor").mkdir()
    (staging / "actor" / "weights.pt").write_bytes(b"x" * step)
    return manager.commit(step, {"dataloader": {"epoch": 0, "batches_consumed": step}})


def test_commit_latest_prune_and_resume_modes(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
    assert manager.resolve("auto") is None and manager.resolve("disable") is None
    for step in (2, 4, 6):
        _save(manager, step)
    assert manager.saved_steps() == [4, 6]
    assert manager.resolve("auto") == manager.step_dir(6)
    assert load_trainer_state(manager.step_dir(6)) == {
        "global_step": 6,
        "dataloader": {"epoch": 0, "batches_consumed": 6},
    }
    assert manager.resolve(str(manager.step_dir(4))) == manager.step_dir(4)
    assert manager.resolve("disable") is None
    with pytest.raises(FileNotFoundError, match="trainer.resume_mode=.* has no trainer_state.pt"):
        manager.resolve(str(tmp_path))
    with pytest.raises(ValueError, match="max_checkpoints_to_keep=0"):
        CheckpointManager(tmp_path / "other", max_to_keep=0)


def test_half_written_checkpoint_is_never_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    _save(manager, 2)
    staging = manager.begin(4)  # killed here: the roles wrote, commit never ran
    (staging / "actor").mkdir()
    (staging / TRAINER_STATE_FILE).write_bytes(b"truncat")
    assert manager.resolve("auto") == manager.step_dir(2)
    assert manager.saved_steps() == [2]
    restarted = CheckpointManager(tmp_path / "ckpt")
    assert not staging.exists()
    assert restarted.resolve("auto") == manager.step_dir(2)
    (tmp_path / "ckpt" / "latest").write_text("global_step_9")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        restarted.latest()


def _loop(model: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["--model", str(model), "--run-dir", str(run_dir), "--steps", "6", "--save-freq", "2", *extra]
    return [sys.executable, "-m", "cases.ckpt_train_loop", *args]


@pytest.mark.parametrize("role_layout", ["tp2", "dp2"])
def test_killed_run_resumes_to_the_same_weights_and_data_order(tmp_path: Path, role_layout: str) -> None:
    """tp2: TP=2 with the plain optimizer, synchronous saves; dp2: DP=2 with the distributed optimizer, asynchronous
    saves written while the next step trains. Actor and critic."""
    model = save_random_model("qwen2", tmp_path / "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    layout_args = ("--layout", role_layout)
    straight_run = _loop(model, tmp_path / "straight", "--save-hf", *layout_args)
    subprocess.run(straight_run, check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _loop(model, killed, "--hang-in-save", "4", *layout_args),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (killed / "hanging").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 4's save"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    checkpoints = killed / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step_2"
    assert (checkpoints / ".global_step_4.partial" / "actor" / "model").is_dir()
    assert not (checkpoints / "global_step_4").exists()

    subprocess.run(_loop(model, killed, *layout_args), check=True, env=env, capture_output=True)
    straight = torch.load(tmp_path / "straight" / "result.pt", weights_only=False)
    resumed = torch.load(killed / "result.pt", weights_only=False)
    assert [entry[1] for entry in resumed["history"]] == [entry[1] for entry in straight["history"]]
    assert resumed["history"] == straight["history"]  # same actor and critic losses, adaptive KL coefficients
    initial = SafetensorsReader(model)
    moved = max((straight["weights"][name] - initial.get(name)).abs().max().item() for name in initial.names())
    assert moved > 1e-3  # training changed the weights, so equality below means something
    for name, tensor in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
    exported = SafetensorsReader(tmp_path / "straight" / "checkpoints" / "global_step_6" / "actor" / "hf")
    assert sorted(exported.names()) == sorted(straight["weights"])
    assert all(torch.equal(exported.get(name), tensor) for name, tensor in straight["weights"].items())
    assert straight["value_head"].abs().max() > 0
    assert torch.equal(resumed["value_head"], straight["value_head"])
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_4", "global_step_6", "latest"]
