"""Checkpoint writes that fail on real I/O errors: the save fails loudly (directory and errno), `latest` keeps naming
the previous checkpoint, nothing partial is left, and with on_error=continue the next save works. Disk full is a
file symlinked to /dev/full (ENOSPC on write); an unwritable directory is chmod 0o555 as a normal user, and (root
ignores modes) a path through a regular file (ENOTDIR) as root. One role's Megatron save (2 gloo processes)
returns its I/O error instead of raising."""

import errno
import logging
import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from cases.megatron_cases import save_random_model

from megarl.megatron.launch import spawn
from megarl.trainer.checkpoint import LATEST_FILE, CheckpointError, CheckpointManager

STATE = {"dataloader": {"epoch": 0, "batches_consumed": 1}}


def _write_actor(staging: Path) -> list[OSError | None]:
    (staging / "actor").mkdir()
    (staging / "actor" / "weights.pt").write_bytes(b"weights")
    return [None]


def _disk_full(path: Path) -> None:
    path.symlink_to("/dev/full")


def _saved(manager: CheckpointManager) -> list[str]:
    return sorted(p.name for p in manager.root.iterdir())


def test_disk_full_fails_the_save_and_keeps_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, _write_actor, STATE)

    def fill_then_write(staging: Path) -> list[OSError | None]:
        _disk_full(staging / ".trainer_state.pt.tmp")  # commit writes the trainer state there first
        return _write_actor(staging)

    with pytest.raises(CheckpointError) as caught:
        manager.save(2, fill_then_write, STATE)
    message = str(caught.value)
    assert f"could not save the checkpoint of step 2 under {manager.root}: ENOSPC (No space left on device)" in message
    assert "`latest` names global_step_1" in message and "trainer.on_checkpoint_error=stop" in message
    assert _saved(manager) == ["global_step_1", LATEST_FILE]  # no partial directory left
    assert manager.latest() == manager.step_dir(1)


def test_failed_latest_write_keeps_the_previous_one_and_continue_trains_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`latest` is written after the rename: its failure removes the renamed directory too."""
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, _write_actor, STATE)
    _disk_full(manager.root / ".latest.tmp")
    assert manager.save(2, _write_actor, STATE, on_error="continue") is None
    assert "could not save the checkpoint of step 2" in caplog.text and "ENOSPC" in caplog.text
    assert "training goes on without it (trainer.on_checkpoint_error=continue)" in caplog.text
    assert _saved(manager) == ["global_step_1", LATEST_FILE]  # the symlink went with the failed write
    with caplog.at_level(logging.INFO, logger="megarl"):
        assert manager.save(3, _write_actor, STATE, on_error="continue") == manager.step_dir(3)
    assert manager.latest() == manager.step_dir(3)


def test_unwritable_directory_fails_the_save_and_keeps_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, _write_actor, STATE)
    if os.geteuid() != 0:
        manager.root.chmod(0o555)  # begin cannot create the staging directory
        expected = "EACCES (Permission denied)"
    else:
        manager.staging_dir(2).write_text("")  # a regular file where the staging directory goes
        expected = "ENOTDIR (Not a directory)"
    try:
        with pytest.raises(CheckpointError, match=re.escape(f"step 2 under {manager.root}: {expected}")):
            manager.save(2, _write_actor, STATE)
    finally:
        manager.root.chmod(0o755)
    assert manager.latest() == manager.step_dir(1)
    assert not manager.step_dir(2).exists()


def test_an_io_error_returned_by_a_role_fails_the_save(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")

    def rank_failed(staging: Path) -> list[OSError | None]:
        _write_actor(staging)
        return [None, OSError(errno.ENOSPC, "No space left on device (rank 1)", str(staging / "actor"))]

    with pytest.raises(CheckpointError, match=r"ENOSPC \(No space left on device \(rank 1\)\): .*actor.*no checkpoint"):
        manager.save(1, rank_failed, STATE)
    assert _saved(manager) == []


def rank_saves(model_dir: Path, root: Path) -> list[OSError | None]:
    """On each of 2 ranks (DP2): a save whose collective write meets a full disk on rank 0 only, one into a path
    through a regular file, then a save that works."""
    from megarl.config.model import ModelConfig
    from megarl.config.training import MegatronConfig, OptimConfig
    from megarl.workers.base import RankWorker, build_role

    worker = RankWorker(dist.get_rank(), 2, "cpu")
    model_cfg = ModelConfig(path=str(model_dir), random_init=True, dtype="float32")
    megatron = MegatronConfig(use_distributed_optimizer=False)  # its state_dict needs a step taken
    worker.role = build_role(model_cfg, megatron, weights_path=None, seed=0, optim=OptimConfig())
    if dist.get_rank() == 0:
        (root / "full" / "model").mkdir(parents=True)
        _disk_full(root / "full" / "model" / "__0_0.distcp")  # rank 0's shard file of megatron's writer
        (root / "file").write_text("")
    dist.barrier()
    return [worker.save(str(root / "full")), worker.save(str(root / "file" / "actor")), worker.save(str(root / "ok"))]


def test_a_roles_save_returns_its_io_error_and_the_role_saves_again(tmp_path: Path) -> None:
    model_dir = save_random_model("qwen2", tmp_path / "qwen2")
    rank0, rank1 = spawn(rank_saves, 2, model_dir, tmp_path)
    assert isinstance(rank0[0], OSError) and rank0[0].errno == errno.ENOSPC
    assert "No space left on device" in str(rank0[0]) and str(tmp_path / "full") in str(rank0[0])
    assert isinstance(rank1[0], OSError) and "another rank failed to write" in str(rank1[0])  # the same collective
    for result in (rank0, rank1):
        assert isinstance(result[1], OSError) and result[1].errno == errno.ENOTDIR
    assert rank0[2] is None and rank1[2] is None
    assert {"rank_0.pt", "rank_1.pt", "model", "optimizer"} <= {p.name for p in (tmp_path / "ok").iterdir()}
