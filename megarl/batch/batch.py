"""`Batch`: the one type in which data moves between the driver, the rollout and the workers.

A Batch holds B rows (prompts or trajectories) as

- `tensors`: a `TensorDict` with `batch_size=[B]` (every tensor is `[B, ...]`; it may have no keys),
- `non_tensors`: 1-D numpy object arrays of length B, one Python object per row (messages,
  token-id lists, dicts); lists are converted with one object per row, never into a 2-D array,
- `meta`: batch-level values (not per row), e.g. the step or the sampling temperature.

    batch = Batch.from_dict(tensors={"input_ids": ids}, non_tensors={"uid": uids}, meta={"step": 3})
    prompts = batch.pop(non_tensor_keys=["raw_prompt_ids"])    # moves the keys out of `batch`
    samples = prompts.repeat(n, interleave=True)                # r0 r0 r1 r1 ... (n samples per prompt)
    padded = samples.pad_to_multiple(num_workers)               # meta["num_padding"] counts the added rows
    out = Batch.concat([work(c) for c in padded.chunk(num_workers)]).unpad()
    for mini in out.iter_mini_batches(16, epochs=2, seed=0): ...

`batch["key"]` is a column; `batch[slice | list[int] | int tensor/array | bool mask]` is a new Batch of
those rows with a copy of meta. Row selections copy the columns; `select`, `pop`, `union` and `to`
share the column objects with their source.

Meta rules. `union` and `concat` merge meta: a key held by several batches must hold equal values.
`meta["num_padding"]` (set by `pad_to_multiple`) is the count of padding rows, which are always the
last rows: every row selection recounts it for the rows it keeps and refuses an order that would put
padding before real rows (unpad first, or delete the key to treat the padding as data). `concat`
sums it, and accepts it only where every batch has it and no real row follows a padding row: the
chunks of one padded batch, in order. Any other padded batch must be unpadded before `concat`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch
from tensordict import TensorDict

from megarl.batch.columns import check_tensor, compact, infer_size, merge, object_column

PAD_KEY = "num_padding"


def _require(kind: str, wanted: list[str], present: list[str]) -> None:
    missing = [key for key in wanted if key not in present]
    if missing:
        raise KeyError(f"no {kind} key(s) {missing} in the batch; its {kind} keys are {present}")


def _concat_padding(batches: Sequence[Batch]) -> int:
    """The padding count of a concatenation; padding rows must end it, as for the chunks of one padded batch."""
    after_padding = False
    for i, batch in enumerate(batches):
        if PAD_KEY not in batch.meta:
            raise ValueError(f"concat: batch {i} has no meta['{PAD_KEY}'] but others do; unpad() them first")
        if after_padding and batch.meta[PAD_KEY] != len(batch):
            raise ValueError(
                f"concat: batch {i} has real rows after padding rows of an earlier batch; unpad() each padded "
                "batch first (only the chunks of one padded batch, in order, concatenate while padded)"
            )
        after_padding = after_padding or batch.meta[PAD_KEY] > 0
    return sum(batch.meta[PAD_KEY] for batch in batches)


@dataclass(slots=True, eq=False, repr=False)
class Batch:
    """B rows of tensors and per-row Python objects, plus batch-level meta. See the module docstring."""

    tensors: TensorDict
    """Tensors `[B, ...]` in a TensorDict with `batch_size=[B]`; build from a dict with `from_dict`."""
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row Python objects: each a 1-D numpy object array of length B."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Batch-level values, not per row."""

    def __post_init__(self) -> None:
        self.check()

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> Batch:
        """Build a Batch; B comes from the first column unless `batch_size` is given (required with no columns)."""
        tensors = {} if tensors is None else dict(tensors.items())
        non_tensors = {} if non_tensors is None else non_tensors
        size = infer_size(tensors, non_tensors) if batch_size is None else batch_size
        for key, value in tensors.items():
            check_tensor(key, value, size)
        columns = {key: object_column(key, values, size) for key, values in non_tensors.items()}
        return cls(TensorDict(tensors, batch_size=[size]), columns, dict(meta or {}))

    def check(self) -> None:
        """Raise unless every column has B rows, non-tensors are 1-D object arrays and no key is of both kinds."""
        if not isinstance(self.tensors, TensorDict):
            raise TypeError(f"Batch.tensors must be a TensorDict, got {type(self.tensors).__name__}; use from_dict")
        if self.tensors.batch_dims != 1:
            raise ValueError(f"Batch.tensors must have a 1-D batch_size [B], got {list(self.tensors.batch_size)}")
        size = len(self)
        for key, column in self.non_tensors.items():
            if not isinstance(column, np.ndarray) or column.dtype != object or column.ndim != 1:
                raise TypeError(f"non-tensor {key!r} must be a 1-D numpy object array; use Batch.set or from_dict")
            if len(column) != size:
                raise ValueError(f"non-tensor {key!r} has {len(column)} rows; expected {size} (the batch size)")
        both = sorted(set(self.tensor_keys) & set(self.non_tensors))
        if both:
            raise ValueError(f"keys {both} are both tensors and non-tensors; keep each key in one of them")

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def tensor_keys(self) -> list[str]:
        return [str(key) for key in self.tensors.keys()]  # noqa: SIM118 (iterating a TensorDict yields rows)

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensors)

    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys (not meta)."""
        return self.tensor_keys + self.non_tensor_keys

    def __contains__(self, key: object) -> bool:
        return key in self.non_tensors or key in self.tensor_keys

    def __repr__(self) -> str:
        tensors = ", ".join(f"{key}: {tuple(value.shape)} {value.dtype}" for key, value in self.tensors.items())
        non_tensors = ", ".join(f"{key}: ({len(self)},) object" for key in self.non_tensors)
        return f"Batch(size={len(self)}, tensors={{{tensors}}}, non_tensors={{{non_tensors}}}, meta={list(self.meta)})"

    @overload
    def __getitem__(self, index: str) -> Any: ...

    @overload
    def __getitem__(self, index: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch: ...

    def __getitem__(self, index: Any) -> Any:
        """`batch["key"]`: the tensor or object array; any other index: a new Batch of those rows."""
        if isinstance(index, str):
            if index in self.non_tensors:
                return self.non_tensors[index]
            if index in self.tensor_keys:
                return self.tensors[index]
            raise KeyError(f"no key {index!r} in the batch; it has {self.keys()}")
        if isinstance(index, int | np.integer) or (isinstance(index, torch.Tensor | np.ndarray) and index.ndim == 0):
            row = int(index)
            raise TypeError(f"a Batch is indexed by rows, not by one row; use batch[{row}:{row + 1}]")
        return self._take(self._row_index(index))

    def _row_index(self, index: Any) -> torch.Tensor:
        """Any supported row index as non-negative int64 positions on the CPU."""
        size = len(self)
        if isinstance(index, slice):
            return torch.arange(*index.indices(size))
        rows = index.cpu() if isinstance(index, torch.Tensor) else torch.as_tensor(np.asarray(index))
        if rows.dtype == torch.bool:
            if rows.shape != (size,):
                raise ValueError(
                    f"a boolean row mask must have shape ({size},) (the batch size), got {tuple(rows.shape)}"
                )
            return rows.nonzero().flatten()
        if rows.dim() == 1 and rows.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex:
            raise TypeError(
                f"row index must be 1-D integers or booleans, got {rows.dtype} of shape {tuple(rows.shape)}"
            )
        rows = rows.long()
        if rows.min() < -size or rows.max() >= size:
            raise IndexError(f"row index out of range for a batch of {size} rows: min {rows.min()}, max {rows.max()}")
        return torch.where(rows < 0, rows + size, rows)

    def _take(self, rows: torch.Tensor) -> Batch:
        meta = dict(self.meta)
        if PAD_KEY in meta:
            meta[PAD_KEY] = self._padding_in(rows)
        non_tensors = {key: column[rows.numpy()] for key, column in self.non_tensors.items()}
        return Batch(self.tensors[rows], non_tensors, meta)

    def _padding_in(self, rows: torch.Tensor) -> int:
        """How many of `rows` are padding rows; they must come last so that unpad() stays right."""
        num_padding = self.meta[PAD_KEY]
        is_padding = rows >= len(self) - num_padding  # [len(rows)]
        count = int(is_padding.sum())
        if not is_padding[len(rows) - count :].all():
            raise ValueError(
                f"this row selection puts some of the {num_padding} padding rows before real rows; unpad() first, "
                f"or `del batch.meta['{PAD_KEY}']` to treat the padding rows as data"
            )
        return count

    def set(self, key: str, value: Any) -> None:
        """Add or replace a column: a tensor with dim 0 = B, or any other per-row sequence of length B."""
        if isinstance(value, torch.Tensor):
            check_tensor(key, value, len(self))
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        column = object_column(key, value, len(self))
        if key in self.tensor_keys:
            del self.tensors[key]
        self.non_tensors[key] = column

    def select(
        self,
        tensor_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A new Batch with only these keys (None = all keys of that kind); self is unchanged."""
        tensor_keys = self.tensor_keys if tensor_keys is None else list(tensor_keys)
        non_tensor_keys = self.non_tensor_keys if non_tensor_keys is None else list(non_tensor_keys)
        meta_keys = list(self.meta) if meta_keys is None else list(meta_keys)
        _require("tensor", tensor_keys, self.tensor_keys)
        _require("non-tensor", non_tensor_keys, self.non_tensor_keys)
        _require("meta", meta_keys, list(self.meta))
        return Batch(
            self.tensors.select(*tensor_keys),
            {key: self.non_tensors[key] for key in non_tensor_keys},
            {key: self.meta[key] for key in meta_keys},
        )

    def pop(
        self, tensor_keys: Iterable[str] = (), non_tensor_keys: Iterable[str] = (), meta_keys: Iterable[str] = ()
    ) -> Batch:
        """Move these keys out of self into a new Batch of the same size."""
        taken = self.select(tensor_keys, non_tensor_keys, meta_keys)
        for key in taken.tensor_keys:
            del self.tensors[key]
        for key in taken.non_tensor_keys:
            del self.non_tensors[key]
        for key in taken.meta:
            del self.meta[key]
        return taken

    def union(self, other: Batch) -> Batch:
        """A new Batch with the keys of both; sizes must match and a key in both must hold equal values."""
        if len(self) != len(other):
            raise ValueError(f"cannot union a batch of {len(self)} rows with one of {len(other)} rows")
        tensors = dict(self.tensors.items())
        non_tensors = dict(self.non_tensors)
        meta = dict(self.meta)
        merge(tensors, dict(other.tensors.items()), "union: tensor")
        merge(non_tensors, other.non_tensors, "union: non-tensor")
        merge(meta, other.meta, "union: meta")
        return Batch(TensorDict(tensors, batch_size=[len(self)]), non_tensors, meta)

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row `times` in a row (interleave: r0 r0 r1 r1) or the whole batch `times` over (r0 r1 r0 r1)."""
        if times < 1:
            raise ValueError(f"repeat times={times} must be >= 1")
        rows = torch.arange(len(self))
        return self._take(rows.repeat_interleave(times) if interleave else rows.repeat(times))

    def chunk(self, num_chunks: int) -> list[Batch]:
        """`num_chunks` parts of equal size, in order."""
        if num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks} must be >= 1")
        if len(self) % num_chunks:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} rows into {num_chunks} equal parts; call "
                f"pad_to_multiple({num_chunks}) first and unpad() after concatenating the results"
            )
        return self.split([len(self) // num_chunks] * num_chunks)

    def split(self, split_size: int | Sequence[int]) -> list[Batch]:
        """Like torch.split: parts of `split_size` rows (the last may be shorter), or of the listed sizes."""
        if isinstance(split_size, int):
            if split_size < 1:
                raise ValueError(f"split_size={split_size} must be >= 1")
            sizes = [min(split_size, len(self) - start) for start in range(0, len(self), split_size)]
        else:
            sizes = list(split_size)
            if sum(sizes) != len(self) or any(s < 0 for s in sizes):
                raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the batch size {len(self)}")
        bounds = itertools.accumulate(sizes, initial=0)
        return [self[start:end] for start, end in itertools.pairwise(bounds)]

    def pad_to_multiple(self, divisor: int) -> Batch:
        """A copy grown to a multiple of `divisor` rows by copies of the first rows, cyclically.

        `meta["num_padding"]` records the count (0 when none were needed); `unpad()` removes them.
        """
        if divisor < 1:
            raise ValueError(f"divisor={divisor} must be >= 1")
        if PAD_KEY in self.meta:
            raise ValueError(f"batch is already padded (meta['{PAD_KEY}']={self.meta[PAD_KEY]}); unpad() it first")
        num_padding = -len(self) % divisor
        rows = torch.arange(len(self) + num_padding) % max(len(self), 1)  # r0 .. r{B-1}, then r0 r1 ...
        padded = self._take(rows)
        padded.meta[PAD_KEY] = num_padding
        return padded

    def unpad(self) -> Batch:
        """A copy without the rows pad_to_multiple added and without meta['num_padding']."""
        if PAD_KEY not in self.meta:
            raise ValueError(f"cannot unpad: meta has no '{PAD_KEY}', so the batch was not padded by pad_to_multiple")
        out = self[: len(self) - self.meta[PAD_KEY]]
        del out.meta[PAD_KEY]
        return out

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """The rows of all batches in order; keys, row shapes and dtypes must match (meta: see module docstring)."""
        if not batches:
            raise ValueError("concat needs at least one batch, got an empty list")
        first = batches[0]
        for i, batch in enumerate(batches[1:], 1):
            if set(batch.tensor_keys) != set(first.tensor_keys) or set(batch.non_tensors) != set(first.non_tensors):
                differing = sorted(set(batch.keys()) ^ set(first.keys()))
                raise ValueError(f"concat: batch {i} has different keys from batch 0: {differing}")
            for key in first.tensor_keys:
                mine, theirs = batch.tensors[key], first.tensors[key]
                if mine.shape[1:] != theirs.shape[1:] or mine.dtype != theirs.dtype:
                    raise ValueError(
                        f"concat: tensor {key!r} of batch {i} has rows of shape {tuple(mine.shape[1:])} {mine.dtype}, "
                        f"batch 0 has {tuple(theirs.shape[1:])} {theirs.dtype}"
                    )
        meta: dict[str, Any] = {}
        for batch in batches:
            merge(meta, {key: value for key, value in batch.meta.items() if key != PAD_KEY}, "concat: meta")
        if any(PAD_KEY in batch.meta for batch in batches):
            meta[PAD_KEY] = _concat_padding(batches)
        tensors = {key: torch.cat([batch.tensors[key] for batch in batches]) for key in first.tensor_keys}
        non_tensors = {key: np.concatenate([b.non_tensors[key] for b in batches]) for key in first.non_tensor_keys}
        return Batch(TensorDict(tensors, batch_size=[sum(len(b) for b in batches)]), non_tensors, meta)

    def iter_mini_batches(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = True, seed: int = 0
    ) -> Iterator[Batch]:
        """B // mini_batch_size mini-batches per epoch; epoch e is shuffled by a torch.Generator seeded seed + e."""
        if mini_batch_size < 1 or len(self) % mini_batch_size:
            raise ValueError(
                f"a batch of {len(self)} rows does not divide into mini-batches of {mini_batch_size}; "
                f"choose a mini_batch_size that divides {len(self)}"
            )
        return self._mini_batches(mini_batch_size, epochs, shuffle, seed)

    def _mini_batches(self, mini_batch_size: int, epochs: int, shuffle: bool, seed: int) -> Iterator[Batch]:
        for epoch in range(epochs):
            if shuffle:
                order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch))
            else:
                order = torch.arange(len(self))
            for rows in order.view(-1, mini_batch_size):  # [B // mini_batch_size, mini_batch_size]
                yield self._take(rows)

    def to(self, device: str | torch.device) -> Batch:
        """A new Batch with the tensors on `device`; the non-tensor arrays and meta values are shared."""
        return Batch(self.tensors.to(device), dict(self.non_tensors), dict(self.meta))

    def __getstate__(self) -> dict[str, Any]:
        """Plain compact tensors, not the TensorDict, so pickle and Ray ship only this batch's data."""
        return {
            "batch_size": len(self),
            "device": self.tensors.device,
            "tensors": {key: compact(self.tensors[key]) for key in self.tensor_keys},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = TensorDict(state["tensors"], batch_size=[state["batch_size"]], device=state["device"])
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]
