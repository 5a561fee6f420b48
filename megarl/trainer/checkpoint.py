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

An asynchronous save (trainer.async_save) is `start`ed: the roles only stage their state and their writer processes
write it while training goes on; `finish`, called every step, commits it once every rank has written its part and
the HF export (run in a thread of this process, after the writes) returned. Until then `latest` names the previous
checkpoint, so a kill mid-save resumes from that one; one save is in flight at a time.

Usage::

    manager = CheckpointManager(run_dir / "checkpoints", max_to_keep=3)
    staging = manager.begin(step)                           # roles save into staging / "actor", ...
    export_hf(staging / "actor", cfg.model.path, lora=False)  # optional, before commit
    manager.commit(step, {"dataloader": loader.state_dict(), ...})
    manager.save(step, write_roles, trainer_state, on_error="stop")  # the three above, guarded
    manager.start(step, start_roles, trainer_state, "stop")  # asynchronous: staged, pending
    manager.finish(all_written, export, blocking=False)     # every step: commits once written and exported
    resume_from = manager.resolve(cfg.trainer.resume_mode)  # Path | None
"""

import errno
import functools
import logging
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.config.trainer import TRAINER_STATE_FILE

logger = logging.getLogger("megarl")

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest"
WriteRoles = Callable[[Path], list[OSError | None]]
"""Saves (or starts saving) every trainable role under a staging directory; each rank's I/O error, or None."""
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


@dataclass(kw_only=True, slots=True)
class PendingSave:
    """An asynchronous save that `latest` does not name yet."""

    step: int
    trainer_state: dict[str, Any]
    on_error: str
    export: Future[object] | None = None
    """The HF export of the written checkpoint (trainer.save_hf_weights), started once every rank wrote its part."""


class CheckpointManager:
    def __init__(self, root: str | Path, max_to_keep: int | None = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_checkpoints_to_keep={max_to_keep} must be >= 1 (or null to keep all)")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending: PendingSave | None = None
        for stale in self.root.glob(".*.partial"):  # a killed rank's writer process may still be writing there
            shutil.rmtree(stale, ignore_errors=True)

    @functools.cached_property
    def _exporter(self) -> ThreadPoolExecutor:
        """The HF exports' thread, made at the first asynchronous save."""
        return ThreadPoolExecutor(1, thread_name_prefix="megarl-checkpoint-export")

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
        `commit`, guarded (`guarded`)."""

        def write_and_commit() -> Path:
            self._write(step, write_roles)
            return self.commit(step, trainer_state)

        final = self.guarded(step, on_error, write_and_commit)
        if final is not None:
            logger.info("checkpoint: %s", final)
        return final

    def start(self, step: int, write_roles: WriteRoles, trainer_state: dict[str, Any], on_error: str) -> bool:
        """`begin` and `write_roles(staging)`, which only starts the roles' writes (asynchronous saves), guarded; the
        save is pending until `finish` commits it. Whether it started."""
        self.pending = PendingSave(step=step, trainer_state=trainer_state, on_error=on_error)
        if self.guarded(step, on_error, lambda: self._write(step, write_roles)) is None:
            self.pending = None
        return self.pending is not None

    def finish(self, written: Callable[[], bool], export: Callable[[Path], object] | None, blocking: bool) -> None:
        """Commit the pending save once `written()` says every rank wrote its part and `export(staging)` (started
        in a thread then) returned; without `blocking` each call only looks, so a step is never held up by it. Both
        may raise OSError: guarded (`guarded`), with the policy the save started with."""
        pending = self.pending
        if pending is None:
            return
        self.guarded(pending.step, pending.on_error, lambda: self._settle(pending, written, export, blocking))

    def _settle(
        self, pending: PendingSave, written: Callable[[], bool], export: Callable[[Path], object] | None, blocking: bool
    ) -> Path:
        staging = self.staging_dir(pending.step)
        if pending.export is None:
            if not written():
                return staging
            pending.export = self._exporter.submit(export or (lambda path: None), staging)
        if not (blocking or pending.export.done()):
            return staging
        pending.export.result()
        self.pending = None
        final = self.commit(pending.step, pending.trainer_state)
        logger.info("checkpoint: %s", final)
        return final

    def guarded(self, step: int, on_error: str, work: Callable[[], Any]) -> Any:
        """`work()`, whose I/O error anywhere removes what this save of `step` wrote where the filesystem allows (and
        forgets a pending save); `latest` keeps naming the previous checkpoint; then on_error="stop" raises
        `CheckpointError` (the directory and the errno), "continue" logs it and returns None."""
        try:
            return work()
        except OSError as err:
            self.pending = None
            self._discard(step)
            message = (
                f"could not save the checkpoint of step {step} under {self.root}: {describe(err)}; "
                f"`latest` names {self._latest_name() or 'no checkpoint yet'}"
            )
            if on_error != "continue":
                raise CheckpointError(f"{message} (trainer.on_checkpoint_error=stop, or continue to train on)") from err
            logger.error("%s; training goes on without it (trainer.on_checkpoint_error=continue)", message)
            return None

    def _write(self, step: int, write_roles: Callable[[Path], list[OSError | None]]) -> Path:
        staging = self.begin(step)
        for error in write_roles(staging):
            if error is not None:
                raise error
        return staging

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
        return self.latest_in(self.root)

    @staticmethod
    def latest_in(root: Path) -> Path | None:
        """The checkpoint `root/latest` names, or None (read only: no manager, nothing removed)."""
        latest_file = root / LATEST_FILE
        if not latest_file.is_file():
            return None
        path = root / latest_file.read_text().strip()
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


def export_hf(role_dir: str | Path, model_path: str | Path, lora: bool, out: str | Path | None = None) -> Path:
    """Write the role checkpoint `role_dir/model` as HF safetensors in `out` (default `role_dir/hf`), with the config
    and tokenizer files of `model_path` (megarl-convert's mcore-to-hf, streamed; `lora`: the checkpoint holds adapters
    only, merged into `model_path`'s weights as lora-merge does). On a staging directory it is committed with the
    rest. Returns `out`."""
    from megarl.convert.lora import merge_lora
    from megarl.convert.stream import mcore_to_hf

    target = Path(out) if out is not None else Path(role_dir) / "hf"
    model = Path(role_dir) / "model"
    stats = merge_lora(model, model_path, target) if lora else mcore_to_hf(model, model_path, target)
    logger.info("HF export: %s (%d tensors)", target, stats.num_tensors)
    return target


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """What `commit` stored: `global_step` plus the trainer state passed to it."""
    return torch.load(Path(checkpoint) / TRAINER_STATE_FILE, weights_only=False)
