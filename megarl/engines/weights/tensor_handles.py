"""Named tensors passed to a colocated engine by handle, in SGLang's `update_weights_from_tensor` formats.

Each entry of `serialized_named_tensors` is standard base64 of a ForkingPickler dump
(srt/utils/common.py::MultiprocessingSerializer), unpickled through an allow-list
(`SafeUnpickler`). What is dumped depends on `load_format` (model_runner_components/weight_updater.py):
- null: `[(hf_name, tensor), ...]`, one handle per tensor;
- `flattened_bucket`: `{"flattened_tensor": uint8 tensor, "metadata": [...]}`, one handle per bucket;
  each metadata entry has FlattenedTensorMetadata's fields (srt/weight_sync/tensor_bucket.py) and
  is read by attribute (`_update_weights_from_flattened_bucket`), so a `types.SimpleNamespace`
  (on SGLang's allow-list) stands in for the class megarl cannot import.
Pickling shares the storage instead of copying it: CUDA tensors become CUDA IPC handles; CPU
tensors are moved to a named shared-memory file (torch's file_system strategy), which an unrelated
process can open. The sender must keep the tensors alive until the engine has answered.

A CUDA handle names its GPU by UUID, not by the sender's device index (a Ray actor that sees one GPU
calls it 0 whichever it is): the pickler used here reduces CUDA tensors with the UUID in the device
argument, as SGLang's `srt/utils/patch_torch.py::_reduce_tensor_modified` does, and SGLang's
receiver (`_rebuild_cuda_tensor_modified`, installed before it decodes) maps the UUID to its own
index. Only this pickler is changed; torch's global reductions stay as they are.
"""

import base64
import functools
import io
import os
import pickle
import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch.multiprocessing import reductions

SENDABLE_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
"""dtypes a payload may name (pickled as the globals `torch.<name>`)."""

ALLOWED_GLOBALS = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("types", "SimpleNamespace"),  # flattened_bucket metadata entries
    }
    | {("torch", str(dtype).removeprefix("torch.")) for dtype in SENDABLE_DTYPES}
)
"""The globals a payload may load: a subset of SGLang's `SafeUnpickler.ALLOWED_GLOBALS`
(srt/utils/common.py), so what this engine accepts SGLang accepts too (tests/dist/test_sglang_contract.py)."""


@functools.cache
def _close_inherited_fds_on_exec() -> None:
    """Stop the inheritable descriptors of this process leaking into torch_shm_manager.

    The first file_system share starts that daemon, and it outlives us while an engine still maps
    our memory. Had it inherited e.g. the pipe a multiprocessing parent watches for our exit, the
    parent would wait for the engine, and a parent that stops the engine afterwards never would.
    Once per process: descriptors Python opens later are not inheritable anyway.
    """
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        if fd > 2:
            with suppress(OSError):
                os.set_inheritable(fd, False)


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch's file_system sharing strategy within the block (named shared memory an unrelated process can open)."""
    _close_inherited_fds_on_exec()
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(previous)


LOAD_FORMATS = (None, "flattened_bucket")
"""The `update_weights_from_tensor` load formats megarl sends and the embedded engine reads."""


DEVICE_ARG = 6
"""Index of `storage_device` among `rebuild_cuda_tensor`'s arguments (SGLang's `_REDUCE_TENSOR_ARG_DEVICE_INDEX`)."""


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`, the form SGLang's receiver maps back to an index."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str) -> int:
    """A handle's device argument (an index, or a UUID) → this process's index of that GPU."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == device:
            return index
    raise ValueError(f"no visible CUDA device has UUID {device}; the sender's GPU is not one of this engine's")


def _reduce_naming_device(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1 :])
    return rebuild, args


def _serialize(payload: object) -> str:
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_naming_device
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_naming_device
    with file_system_sharing():
        pickler.dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One load_format=null entry; CPU tensors are moved into shared memory in place."""
    return _serialize(named)


def serialize_tensor_dict(tensors: dict[str, torch.Tensor]) -> str:
    """One load_format=null entry of `/load_lora_adapter_from_tensors`: a `{name: tensor}` dict, where weight updates
    send `[(name, tensor)]` (SGLang's tp_worker.py::load_lora_adapter_from_tensors reads the dict's items; its
    engine.py::Engine.load_lora_adapter_from_tensors serializes one). CPU tensors move into shared memory."""
    return _serialize(dict(tensors))


def serialize_flattened_bucket(flat: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> str:
    """One load_format=flattened_bucket entry: `flat` by one handle, and where each named view lies in it.

    Every tensor of `named` must be a contiguous view inside `flat` (as the sync executor packs them).
    """
    buffer = flat.view(-1).view(torch.uint8)  # [bytes]
    metadata = []
    for name, view in named:
        start, size = view.data_ptr() - buffer.data_ptr(), view.numel() * view.element_size()
        if not view.is_contiguous() or start < 0 or start + size > buffer.numel():
            raise ValueError(f"{name} is not a contiguous view inside the flattened bucket")
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=view.shape, dtype=view.dtype, start_idx=start, end_idx=start + size, numel=size
            )
        )
    return _serialize({"flattened_tensor": buffer, "metadata": metadata})


class _SafeUnpickler(pickle.Unpickler):
    """Loads only `ALLOWED_GLOBALS`: torch's sharing reductions, storage/tensor classes, dtypes, metadata."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"serialized tensors may not reference {module}.{name}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` with the device argument (index or UUID) mapped to this process's index."""
    args = (*args[:DEVICE_ARG], device_index(args[DEVICE_ARG]), *args[DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


_SHARED_NAME = re.compile(r"^/torch_(\d+)_")


def sharing_pid(tensor: torch.Tensor) -> int | None:
    """The pid of the process that put a CPU tensor mapped from a handle into shared memory.

    torch's file_system strategy names the memory `/torch_<pid>_<random>_<counter>` after the process
    that created it (torch/csrc/StorageSharing.cpp, the `_share_filename_cpu_` path); None when a
    tensor is not in such memory.
    """
    storage = tensor.untyped_storage()
    if tensor.is_cuda or not storage.is_shared():  # sharing an unshared storage would move it
        return None
    try:
        _, name, _ = storage._share_filename_cpu_()
    except RuntimeError:
        return None
    match = _SHARED_NAME.match(name.decode())
    return int(match.group(1)) if match else None


def _unpickle(entry: str) -> object:
    return _SafeUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


def deserialize_named_tensors(entry: str, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The `[(name, tensor)]` of one entry in `load_format`; the tensors map the sender's memory (no copy)."""
    payload = _unpickle(entry)
    if load_format == "flattened_bucket":
        return _unflatten(payload)
    if not isinstance(payload, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in payload
    ):
        raise ValueError("a load_format=null entry must unpickle to a list of (name, tensor) pairs")
    return payload


def deserialize_tensor_dict(entry: str, load_format: str | None = None) -> dict[str, torch.Tensor]:
    """The `{name: tensor}` of one `/load_lora_adapter_from_tensors` entry in `load_format` (mapping the sender's
    memory, no copy)."""
    payload = _unpickle(entry)
    if load_format == "flattened_bucket":
        return dict(_unflatten(payload))
    if not isinstance(payload, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items()
    ):
        raise ValueError("a load_format=null adapter entry must unpickle to a {name: tensor} dict")
    return payload


def _unflatten(payload: object) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's bytes, as `FlattenedTensorBucket.reconstruct_tensors` slices them."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise ValueError("a flattened_bucket entry must unpickle to {flattened_tensor, metadata}")
    buffer, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("flattened_bucket: flattened_tensor must be a 1-D uint8 tensor")
    try:
        return [(str(m.name), buffer[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)) for m in metadata]
    except (AttributeError, RuntimeError, TypeError) as e:
        raise ValueError(f"flattened_bucket: bad metadata entry: {e}") from e
