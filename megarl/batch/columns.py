"""Column-level helpers of `Batch` (megarl/batch/batch.py): type/size checks, object columns, equality."""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

NO_RECORD = -1
"""A `routed_experts` entry with no routing recorded (padding, a sequence's last token, tool tokens after the last
turn): that token is routed live."""
ROUTING_COLUMN = "routed_experts"
MULTI_MODAL_COLUMN = "multi_modal_inputs"
"""Non-tensor column of a vision-language batch: per row `{"pixel_values", "image_grid_thw"}` or None
(`megarl.data.images`, `megarl.megatron.vision`)."""
"""The batch column of routings to replay: `[B, S, moe_layers·k]`, only the MoE layers (`agents.postprocess`)."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type that holds expert indices 0..num_experts-1 and `NO_RECORD`."""
    for dtype in (torch.int8, torch.int16):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int32


def check_tensor(key: str, value: Any, size: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tensor {key!r} must be a torch.Tensor, got {type(value).__name__}; use non_tensors")
    if value.dim() == 0 or value.shape[0] != size:
        raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}; expected dim 0 = {size} (the batch size)")


def object_column(key: str, values: Any, size: int) -> np.ndarray:
    """One object per row, even when rows are lists (np.array would build a 2-D array)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise TypeError(f"non-tensor {key!r} must be a sequence with one object per row, got {type(values).__name__}")
    if len(values) != size:
        raise ValueError(f"non-tensor {key!r} has {len(values)} rows; expected {size} (the batch size)")
    column = np.empty(size, dtype=object)  # [B]
    for i, value in enumerate(values):
        column[i] = value
    return column


def infer_size(tensors: Mapping[str, Any], non_tensors: Mapping[str, Any]) -> int:
    for value in tensors.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    for values in non_tensors.values():
        return len(values)
    raise ValueError("cannot infer the batch size: no tensor with a batch dim and no non-tensor; pass batch_size=")


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone in a contiguous storage, so pickling does not ship the larger tensor it is a view of."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def same(a: Any, b: Any) -> bool:
    """Tensors by dtype and torch.equal, numpy arrays element by element, anything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        both = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
        return both and all(same(x, y) for x, y in zip(a.flat, b.flat, strict=True))
    return bool(a == b)


def merge(into: dict[str, Any], other: Mapping[str, Any], what: str) -> None:
    """Add `other` to `into`; a key in both must hold equal values."""
    for key, value in other.items():
        if key in into and not same(into[key], value):
            raise ValueError(f"{what} {key!r} differs between the batches")
        into[key] = value
