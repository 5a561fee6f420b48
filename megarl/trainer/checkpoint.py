"""Trainer checkpoints that survive a kill at any moment.

Layout under `<run_dir>/checkpoints/`::

    global_step_20/
        trainer_state.pt      global step + the controller's state (dataloader position, KL controller, ...)
        actor/  critic/       each role's `megarl.megatron.dist_ckpt.save_trainable` output
        actor/hf/             HF safetensors of the actor, when trainer.save_hf_weights (`export_hf`)
    .global_step_30.partial/  a save in progress (or killed): never read
    latest                    "global_step_20", replaced atomically after the rename

A save goes to `.global_step_<k>.partial/`; `commit` writes the trainer state there, renames
the directory to `global_step_<k>` and only then points `latest` at it, then drops the oldest
checkpoints beyond `max_to_keep`. A process killed before the rename leaves only a partial
directory, which the next manager removes. `save` does all of it and handles I/O errors (disk
full, permission denied, here or in a role's ranks): it removes what it wrote, `latest` keeps
naming the previous checkpoint, and it raises `CheckpointError` or, to train on, logs the error.

Usage::

    manager = CheckpointManager(run_dir / "checkpoints", max_to_keep=3)
    staging = manager.begin(step)                           # roles save into staging / "actor", ...
    export_hf(staging / "actor", cfg.model.path)            # optional, before commit
    manager.commit(step, {"dataloader": loader.state_dict(), ...})
    manager.save(step, write_roles, trainer_state, on_error="stop")  # the three above, guarded
    resume_from = manager.resolve(cfg.trainer.resume_mode)  # Path | None
"""

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from megarl.config.trainer import TRAINER_STATE_FILE

logger = logging.getLogger("megarl")

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def staging_dir(root: str | Path, step: int) -> Path:
    """Where step `step` is written until `commit` renames it (the same path on every process)."""
    return Path(root) / f".{STEP_PREFIX}{step}.partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, err.filename or str(path)) from err


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (trainer.on_checkpoint_error=stop)."""


def describe(err: OSError) -> str:
    """`ENOSPC (No space left on device): /path` of an I/O error."""
    name = errno.errorcode.get(err.errno, f"errno {err.errno}") if err.errno is not None else "no errno"
    return f"{name} ({err.strerror or err})" + (f": {err.filename}" if err.filename else "")


class CheckpointManager:
    def __init__(self, root: str | Path, max_to_keep: int | None = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_checkpoints_to_keep={max_to_keep} must be >= 1 (or null to keep all)")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".*.partial"):
            shutil.rmtree(stale)

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    def staging_dir(self, step: int) -> Path:
        return staging_dir(self.root, step)

    def begin(self, step: int) -> Path:
        """A fresh staging directory for step `step`; every role writes its state under it."""
        staging = self.staging_dir(step)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        return staging

    def commit(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Finish step `step`'s checkpoint: trainer state, rename into place, `latest`, prune."""
        staging = self.staging_dir(step)
        if not staging.is_dir():
            raise FileNotFoundError(f"{staging} does not exist: call begin({step}) and save the roles first")
        state = {"global_step": step, **trainer_state}
        _write_atomically(staging / TRAINER_STATE_FILE, lambda f: torch.save(state, f))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(self.root)
        _write_atomically(self.root / LATEST_FILE, lambda f: f.write(final.name.encode()))
        self._prune(keep=final)
        return final

    def save(
        self,
        step: int,
        write_roles: Callable[[Path], list[OSError | None]],
        trainer_state: dict[str, Any],
        on_error: str = "stop",
    ) -> Path | None:
        """`begin`, `write_roles(staging)` (the roles save under it; each rank's I/O error comes back, or None),
        `commit`. On an I/O error anywhere, what this save wrote is removed where the filesystem allows and `latest`
        keeps naming the previous checkpoint; then on_error="stop" raises `CheckpointError` (the directory and
        the errno), "continue" logs it and returns None."""
        try:
            for error in write_roles(self.begin(step)):
                if error is not None:
                    raise error
            final = self.commit(step, trainer_state)
        except OSError as err:
            self._discard(step)
            message = (
                f"could not save the checkpoint of step {step} under {self.root}: {describe(err)}; "
                f"`latest` names {self._latest_name() or 'no checkpoint yet'}"
            )
            if on_error != "continue":
                raise CheckpointError(f"{message} (trainer.on_checkpoint_error=stop, or continue to train on)") from err
            logger.error("%s; training goes on without it (trainer.on_checkpoint_error=continue)", message)
            return None
        logger.info("checkpoint: %s", final)
        return final

    def _latest_name(self) -> str | None:
        latest_file = self.root / LATEST_FILE
        return latest_file.read_text().strip() if latest_file.is_file() else None

    def _discard(self, step: int) -> None:
        """Remove what a failed save of `step` wrote, where the filesystem allows: its staging directory, and its
        step directory unless `latest` names it already (a save that failed while pruning)."""
        shutil.rmtree(self.staging_dir(step), ignore_errors=True)
        if self._latest_name() != self.step_dir(step).name:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def saved_steps(self) -> list[int]:
        """Steps of complete checkpoints, oldest first."""
        steps = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / TRAINER_STATE_FILE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _prune(self, keep: Path) -> None:
        if self.max_to_keep is None:
            return
        steps = self.saved_steps()
        for step in steps[: max(len(steps) - self.max_to_keep, 0)]:
            if self.step_dir(step) != keep:
                shutil.rmtree(self.step_dir(step))

    def latest(self) -> Path | None:
        """The checkpoint `latest` names, or None when there is none yet."""
        latest_file = self.root / LATEST_FILE
        if not latest_file.is_file():
            return None
        path = self.root / latest_file.read_text().strip()
        if not (path / TRAINER_STATE_FILE).is_file():
            raise FileNotFoundError(f"{latest_file} names {path}, which is not a complete checkpoint")
        return path

    def resolve(self, resume_mode: str) -> Path | None:
        """trainer.resume_mode → the checkpoint to resume from: auto | disable | a checkpoint directory."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode)
        if not (path / TRAINER_STATE_FILE).is_file():
            raise FileNotFoundError(
                f"trainer.resume_mode={resume_mode!r} has no {TRAINER_STATE_FILE}: "
                f"give a {STEP_PREFIX}<k> directory, auto or disable"
            )
        return path


def export_hf(role_dir: str | Path, hf_config_dir: str | Path) -> Path:
    """Write `role_dir/model` as HF safetensors in `role_dir/hf` (streamed; config and tokenizer copied
    from `hf_config_dir`). Call it on the staging directory so the export is committed with the rest."""
    from megarl.convert.stream import mcore_to_hf

    out = Path(role_dir) / "hf"
    mcore_to_hf(Path(role_dir) / "model", hf_config_dir, out)
    return out


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """What `commit` stored: `global_step` plus the trainer state passed to it."""
    return torch.load(Path(checkpoint) / TRAINER_STATE_FILE, weights_only=False)
