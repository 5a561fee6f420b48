"""Save and load a role's Megatron state as dist checkpoints: model, optimizer, LR schedule, RNG.

Layout of one role's directory (all collective over the role's processes)::

    model/          torch_dist checkpoint of the weights; loads at any TP/PP/EP
    optimizer/      torch_dist checkpoint of the optimizer state (needs the same layout to resume)
    rank_<r>.pt     this process's LR schedule and RNG states

A checkpoint written by `megarl-convert hf-to-mcore` has no `_extra_state` objects (megatron's
per-layer FP8 metadata); loading tolerates their absence.
"""

import multiprocessing as mp
import queue
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch import nn

from megarl.megatron.dcp_io import stored_entries
from megarl.megatron.model import ADAPTERS
from megarl.megatron.optim import Trainable, unwrap
from megarl.megatron.parallel import RoleGroups

_DIST_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_EMBEDDING = "embedding.word_embeddings.weight"
_RESULT_WAIT_S = 60.0
"""How long the rank waits for an exited writer's result to come through the pipe (it is already in it)."""


@contextmanager
def _role_dp_rank(groups: RoleGroups) -> Iterator[None]:
    """megatron-core 0.16 asks the global parallel state for the DP×CP rank when the last pipeline stage
    ties its output layer to the embedding (`tie_embeddings_and_output_weights_state_dict`); megarl
    builds no global groups, so its override variable carries this role's rank meanwhile."""
    previous = parallel_state._MPU_DATA_PARALLEL_RANK
    parallel_state._MPU_DATA_PARALLEL_RANK = groups.pgs.dp_cp.rank()
    try:
        yield
    finally:
        parallel_state._MPU_DATA_PARALLEL_RANK = previous


@contextmanager
def _results_in_process() -> Iterator[None]:
    """megatron's torch_dist writer reports its results through a queue it makes on a rank's first save from a
    spawn-context `Manager()` (filesystem_async.py `_get_write_results_queue`): a server process per rank that
    re-imports the rank's main module (about 4 CPU-seconds each on CPU) and lives as long as the rank. A
    synchronous save (`dist_checkpointing.save`, `AsyncRequest.execute_sync`) puts and gets those results in
    the calling process (`write_preloaded_data_multiproc`, `retrieve_write_results`), so a plain queue does;
    megatron's own is put back after, for any asynchronous save, whose writer runs in another process."""
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


class _ResultsPipe:
    """Where asynchronous writers report their results (megatron's `_results_queue`: the writer process `put`s one
    result per save, the rank takes it with `get_nowait` once the writer has exited). A pipe made before the fork,
    which a thread of the rank keeps draining (a pipe's buffer holds 64 KiB, less than a large model's results: the
    writer would wait for a reader while the rank waits for it to exit). Megatron's own queue comes from a
    spawn-context `Manager()`: a server process per rank that re-imports the rank's main module (about 4 CPU-seconds
    in the first save's blocking part, ~210 MB per rank for the rest of the run: bench/soak.py); a fork-context
    manager instead pins the rank's memory image as the rank changes it (+42 MB per 100 steps measured) and holds its
    sockets, which hid a SIGKILLed rank from Ray for 7 minutes."""

    def __init__(self) -> None:
        self._pipe = mp.get_context("fork").SimpleQueue()
        self._received: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._drain, name="megarl-save-results", daemon=True).start()

    def put(self, result: Any) -> None:
        """In the writer process."""
        self._pipe.put(result)

    def get_nowait(self) -> Any:
        """In the rank, after the writer exited: its result is in the pipe or already drained."""
        try:
            return self._received.get(timeout=_RESULT_WAIT_S)
        except queue.Empty:
            raise queue.Empty(f"no result from the checkpoint writer within {_RESULT_WAIT_S} s of its exit") from None

    def _drain(self) -> None:
        while True:
            self._received.put(self._pipe.get())


def _results_queue_by_pipe() -> None:
    """`_ResultsPipe` as megatron's results queue, once per process, before its first asynchronous save would make
    one (filesystem_async.py `_get_write_results_queue`, when the writes are planned)."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = _ResultsPipe()


class SavePlans:
    """A rank's torch_dist save strategies for asynchronous saves, one per directory, that keep their plans and global
    metadata from the first save (megatron-core's `cached_metadata`: later saves skip the planning's all-gathers);
    the first save also validates the shards' coverage (`validate_access_integrity`), later ones trust it."""

    def __init__(self) -> None:
        self.strategies: dict[str, TorchDistSaveShardedStrategy] = {}

    def save(self, name: str, sharded: dict[str, Any], out: Path) -> AsyncRequest:
        _results_queue_by_pipe()
        first = name not in self.strategies
        strategy = self.strategies.setdefault(name, TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True))
        request = dist_checkpointing.save(
            sharded, str(out), strategy, validate_access_integrity=first, async_sharded_save=True
        )
        assert request is not None
        return request


def _save(sharded: dict[str, Any], out: Path) -> None:
    """`dist_checkpointing.save`, synchronous, its results reported in this process. Collective."""
    with _results_in_process():
        dist_checkpointing.save(sharded, str(out))


def _has_adapters(models: list[nn.Module]) -> bool:
    return any(hasattr(model, ADAPTERS) for model in models)


def model_sharded_state_dict(chunks: list[nn.Module], groups: RoleGroups) -> dict[str, Any]:
    """megatron's sharded state dict of the chunks (`model{i}` sub-dicts with virtual pipeline stages). With LoRA
    adapters (`megarl.lora.model`) only theirs: the frozen base comes from model.path, as at the start."""
    metadata = {"dp_cp_group": groups.pgs.dp_cp}
    models = [unwrap(chunk) for chunk in chunks]
    with _role_dp_rank(groups):
        states = [model.sharded_state_dict(metadata=metadata) for model in models]
    if _has_adapters(models):
        states = [{k: v for k, v in state.items() if k.startswith(f"{ADAPTERS}.")} for state in states]
    return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}


def _without_extra_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _without_extra_state(value)
        elif not (isinstance(value, ShardedObject) and key.endswith("_extra_state")):
            out[key] = value
    return out


def save_model(chunks: list[nn.Module], groups: RoleGroups, out_dir: str | Path) -> None:
    """Write the weights of all chunks into an empty (or new) directory. Collective."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(model_sharded_state_dict(chunks, groups), out)


def _check_vocab(model: nn.Module, stored: dict[str, tuple[tuple[int, ...], torch.dtype]], ckpt_dir: Path) -> None:
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if emb is None or _EMBEDDING not in stored:
        return
    rows, want = stored[_EMBEDDING][0][0], emb.num_embeddings  # both padded, full vocabulary
    if rows != want:
        tp = emb.num_embeddings // emb.num_embeddings_per_partition
        raise ValueError(
            f"{ckpt_dir} pads the vocabulary to {rows} rows but tensor-parallel size {tp} pads it to {want}: "
            f"convert again with --tp {tp} (or use a TP size whose padding matches)"
        )


@torch.no_grad()
def load_model(chunks: list[nn.Module], groups: RoleGroups, ckpt_dir: str | Path) -> None:
    """Load weights saved at any TP/PP/EP into this role's chunks. Collective."""
    ckpt = Path(ckpt_dir)
    if not (ckpt / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a megatron dist checkpoint (no metadata.json)")
    stored = stored_entries(ckpt)
    _check_vocab(unwrap(chunks[0]), stored.tensors, ckpt)
    sharded = model_sharded_state_dict(chunks, groups)
    if not any("_extra_state" in key for key in stored.objects):
        sharded = _without_extra_state(sharded)
    state = dist_checkpointing.load(sharded, str(ckpt))
    models = [unwrap(chunk) for chunk in chunks]
    for i, model in enumerate(models):
        result = model.load_state_dict(state if len(models) == 1 else state[f"model{i}"], strict=False)
        frozen = f"{ADAPTERS}." if _has_adapters(models) else None  # a LoRA checkpoint holds the adapters only
        missing = [
            key
            for key in result.missing_keys
            if not key.endswith("_extra_state") and (frozen is None or key.startswith(frozen))
        ]
        if missing or result.unexpected_keys:
            raise KeyError(f"{ckpt}: missing {missing}, unexpected {result.unexpected_keys}")


def _optimizer_metadata(trainable: Trainable) -> dict[str, str] | None:
    return _DIST_OPTIM_METADATA if trainable.optimizer.config.use_distributed_optimizer else None


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (CPU and CUDA) and megatron model-parallel RNG states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_trainable(trainable: Trainable, groups: RoleGroups, out_dir: str | Path) -> None:
    """Weights, optimizer state, LR schedule and this process's RNG states. Collective."""
    out = Path(out_dir)
    save_model(trainable.chunks, groups, out / "model")
    (out / "optimizer").mkdir(parents=True, exist_ok=True)
    _save(_optimizer_sharded(trainable, groups), out / "optimizer")
    _save_rank_state(trainable, out)


def start_save_trainable(
    trainable: Trainable, groups: RoleGroups, out_dir: str | Path, plans: SavePlans
) -> list[AsyncRequest]:
    """What `save_trainable` writes, as megatron-core asynchronous requests (`dist_checkpointing.save` with
    async_sharded_save): the planning and this rank's small files now, the tensors by the requests' writer
    process once scheduled (`megarl.megatron.async_save.AsyncWrites`). `plans` keeps the save plans between saves
    (the state's structure does not change within a run). Collective."""
    out = Path(out_dir)
    for sub in ("model", "optimizer"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    requests = [
        plans.save("model", model_sharded_state_dict(trainable.chunks, groups), out / "model"),
        plans.save("optimizer", _optimizer_sharded(trainable, groups), out / "optimizer"),
    ]
    _save_rank_state(trainable, out)
    return requests


def _optimizer_sharded(trainable: Trainable, groups: RoleGroups) -> dict[str, Any]:
    model_sharded = model_sharded_state_dict(trainable.chunks, groups)
    return trainable.optimizer.sharded_state_dict(model_sharded, metadata=_optimizer_metadata(trainable))


def _save_rank_state(trainable: Trainable, out: Path) -> None:
    rank = torch.distributed.get_rank()
    torch.save({"scheduler": trainable.scheduler.state_dict(), "rng": rng_state()}, out / f"rank_{rank}.pt")


def _create_adam_state(trainable: Trainable) -> None:
    """torch Adam creates its state at the first step, but loading fills existing state (and the
    distributed optimizer reads its `step` while building the state dict): create it, zeroed."""
    for optimizer in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        inner = optimizer.optimizer
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param]["step"] = torch.zeros((), dtype=torch.float32)
                    inner.state[param]["exp_avg"] = torch.zeros_like(param)
                    inner.state[param]["exp_avg_sq"] = torch.zeros_like(param)


def _restore_adam_step(trainable: Trainable) -> None:
    """The distributed optimizer loads Adam's step into its param groups but leaves the per-parameter
    `step` at the value it had before loading (0), which changes the bias correction of every later
    update. Copy it from the param groups."""
    for optimizer in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        inner = optimizer.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if "step" in inner.state[param]:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def load_trainable(trainable: Trainable, groups: RoleGroups, ckpt_dir: str | Path) -> None:
    """Restore what `save_trainable` wrote; the role must have the same layout and process count."""
    ckpt = Path(ckpt_dir)
    rank = torch.distributed.get_rank()
    extra_file = ckpt / f"rank_{rank}.pt"
    if not extra_file.is_file():
        raise FileNotFoundError(f"{extra_file} is missing: resume with the same number of processes as the run had")
    load_model(trainable.chunks, groups, ckpt / "model")
    _create_adam_state(trainable)
    model_sharded = model_sharded_state_dict(trainable.chunks, groups)
    optim_sharded = trainable.optimizer.sharded_state_dict(
        model_sharded, is_loading=True, metadata=_optimizer_metadata(trainable)
    )
    with torch.no_grad():  # the distributed optimizer copies into views of parameters that require grad
        state = dist_checkpointing.load(optim_sharded, str(ckpt / "optimizer"))
        trainable.optimizer.load_state_dict(state)
    _restore_adam_step(trainable)
    extra = torch.load(extra_file, weights_only=False)
    trainable.scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
