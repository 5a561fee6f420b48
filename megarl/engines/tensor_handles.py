"""Named tensors passed to a colocated engine by handle, in SGLang's `update_weights_from_tensor` format.

Each entry of `serialized_named_tensors` is standard base64 of a ForkingPickler dump of
`[(hf_name, tensor), ...]` (srt/utils/common.py::MultiprocessingSerializer). Pickling shares the
storage instead of copying it: CUDA tensors become CUDA IPC handles; CPU tensors are moved to a
named shared-memory file (torch's file_system strategy), which an unrelated process can open.
The sender must keep the tensors alive until the engine has answered.
"""

import base64
import functools
import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as tmp

_ALLOWED = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_cuda_tensor",
    },
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "torch": {"Tensor", "Size"},
}


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


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry; CPU tensors are moved into shared memory in place."""
    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _SafeUnpickler(pickle.Unpickler):
    """Only torch's sharing reductions, storage/tensor classes and dtypes may be loaded."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"serialized tensors may not reference {module}.{name}")


def deserialize_named_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """The `[(name, tensor)]` list of one entry; the tensors map the sender's memory (no copy)."""
    named = _SafeUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise ValueError("a serialized_named_tensors entry must unpickle to a list of (name, tensor) pairs")
    return named
