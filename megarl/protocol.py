"""`Batch`: the one type in which data moves between the driver, the rollout and the workers.

A Batch holds B rows (prompts or trajectories) as

- `tensors`: a `TensorDict` with `batch_size=[B]` (every tensor's dim 0 is B),
- `non_tensors`: 1-D numpy object arrays of length B (one Python object per row: messages,
  token-id lists, dicts),
- `meta`: batch-level values (not per row).

    batch = Batch.from_dict(tensors={"input_ids": ids}, non_tensors={"uid": uids}, meta={"step": 3})
    gen = batch.pop(non_tensor_keys=["raw_prompt_ids"])      # moves the keys out
    samples = gen.repeat(n, interleave=True)                  # r0 r0 r1 r1 …
    padded = samples.pad_to_multiple(num_workers)             # meta["num_padding"] records the pad
    out = Batch.concat([work(c) for c in padded.chunk(num_workers)]).unpad()
    for mini in out.iter_mini_batches(16, epochs=2, seed=0): ...

Rows are selected with `batch[slice | list[int] | int tensor | bool mask]`; `batch["key"]` is a
column. Concatenated batches must agree on their keys and on their meta values.
"""

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

PAD_KEY = "num_padding"


def _object_column(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """One object per row, even when rows are lists (np.array would build a 2-D array)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Batch:
    """B rows of tensors and per-row Python objects, plus batch-level meta."""

    __slots__ = ("meta", "non_tensors", "tensors")

    def __init__(self, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.tensors = tensors
        self.non_tensors = non_tensors
        self.meta = meta
        self.check()

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> "Batch":
        """Build a Batch; B comes from the first column unless `batch_size` is given."""
        tensors, non_tensors = tensors or {}, non_tensors or {}
        if batch_size is None:
            first = next(iter(tensors.values()), None)
            if first is not None:
                batch_size = first.shape[0] if first.dim() else 0
            elif non_tensors:
                batch_size = len(next(iter(non_tensors.values())))
            else:
                raise ValueError("an empty Batch needs an explicit batch_size")
        for key, value in tensors.items():
            if value.dim() == 0 or value.shape[0] != batch_size:
                raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}; expected dim 0 = {batch_size}")
        columns = {key: _object_column(values) for key, values in non_tensors.items()}
        return cls(TensorDict(dict(tensors), batch_size=[batch_size]), columns, dict(meta or {}))

    def check(self) -> None:
        """Raise ValueError unless every column has B rows and no key is both tensor and non-tensor."""
        if len(self.tensors.batch_size) != 1:
            raise ValueError(f"tensors must have a 1-D batch_size, got {list(self.tensors.batch_size)}")
        size = len(self)
        for key, column in self.non_tensors.items():
            if not isinstance(column, np.ndarray) or column.dtype != object or column.ndim != 1:
                raise ValueError(f"non-tensor {key!r} must be a 1-D numpy object array; use Batch.set or from_dict")
            if len(column) != size:
                raise ValueError(f"non-tensor {key!r} has {len(column)} rows; the batch has {size}")
        both = set(self.tensors.keys()) & set(self.non_tensors)
        if both:
            raise ValueError(f"keys {sorted(both)} are both tensors and non-tensors")

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def tensor_keys(self) -> list[str]:
        return [str(k) for k in self.tensors.keys()]  # noqa: SIM118 (iterating a TensorDict yields rows)

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensors)

    def keys(self) -> list[str]:
        return self.tensor_keys + self.non_tensor_keys

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return (
            f"Batch(size={len(self)}, tensors={{{tensors}}}, non_tensors={self.non_tensor_keys}, "
            f"meta={list(self.meta)})"
        )

    def __getitem__(self, index: Any) -> Any:
        """A column for a str key; otherwise a new Batch of the selected rows."""
        if isinstance(index, str):
            if index in self.non_tensors:
                return self.non_tensors[index]
            if index in self.tensor_keys:
                return self.tensors[index]
            raise KeyError(f"no key {index!r} in the batch; it has {self.keys()}")
        if isinstance(index, int | np.integer):
            raise TypeError(f"Batch rows are selected by slice, list, tensor or mask; use batch[{index}:{index + 1}]")
        rows = self._row_index(index)
        return Batch(
            self.tensors[rows],
            {key: column[rows.numpy()] for key, column in self.non_tensors.items()},
            dict(self.meta),
        )

    def _row_index(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            return torch.arange(len(self))[index]
        rows = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
        if rows.dtype == torch.bool:
            if rows.shape != (len(self),):
                raise ValueError(f"a boolean mask must have shape ({len(self)},), got {tuple(rows.shape)}")
            return rows.nonzero().flatten()
        if rows.dim() != 1 or rows.is_floating_point():
            raise TypeError(
                f"row index must be 1-D integers or booleans, got {rows.dtype} of shape {tuple(rows.shape)}"
            )
        return rows.long()

    def set(self, key: str, value: Any) -> None:
        """Add or replace a column: a tensor with dim 0 = B, or any per-row sequence of length B."""
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(self):
                raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}; expected dim 0 = {len(self)}")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        if len(value) != len(self):
            raise ValueError(f"non-tensor {key!r} has {len(value)} rows; the batch has {len(self)}")
        if key in self.tensor_keys:
            del self.tensors[key]
        self.non_tensors[key] = _object_column(value)

    def select(
        self,
        tensor_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> "Batch":
        """A new Batch with only these keys (None = all of that kind); self is unchanged."""
        tk = self.tensor_keys if tensor_keys is None else list(tensor_keys)
        nk = self.non_tensor_keys if non_tensor_keys is None else list(non_tensor_keys)
        mk = list(self.meta) if meta_keys is None else list(meta_keys)
        self._require(tk, self.tensor_keys, "tensor")
        self._require(nk, self.non_tensor_keys, "non-tensor")
        self._require(mk, list(self.meta), "meta")
        return Batch(
            self.tensors.select(*tk) if tk else TensorDict({}, batch_size=self.tensors.batch_size),
            {k: self.non_tensors[k] for k in nk},
            {k: self.meta[k] for k in mk},
        )

    def pop(
        self, tensor_keys: Iterable[str] = (), non_tensor_keys: Iterable[str] = (), meta_keys: Iterable[str] = ()
    ) -> "Batch":
        """Move these keys out of self into a new Batch of the same size."""
        taken = self.select(tensor_keys, non_tensor_keys, meta_keys)
        for key in taken.tensor_keys:
            del self.tensors[key]
        for key in taken.non_tensor_keys:
            del self.non_tensors[key]
        for key in taken.meta:
            del self.meta[key]
        return taken

    @staticmethod
    def _require(wanted: list[str], present: list[str], kind: str) -> None:
        missing = [k for k in wanted if k not in present]
        if missing:
            raise KeyError(f"no {kind} key(s) {missing} in the batch; it has {present}")

    def union(self, other: "Batch") -> "Batch":
        """Keys of both; shared keys must hold equal values, sizes must match."""
        if len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors: dict[str, Any] = dict(self.tensors.items())
        non_tensors: dict[str, Any] = dict(self.non_tensors)
        meta = dict(self.meta)
        for mine, theirs, kind in (
            (tensors, dict(other.tensors.items()), "tensor"),
            (non_tensors, other.non_tensors, "non-tensor"),
            (meta, other.meta, "meta"),
        ):
            for key, value in theirs.items():
                if key in mine and not _same(mine[key], value):
                    raise ValueError(f"union: {kind} key {key!r} differs between the two batches")
                mine[key] = value
        return Batch(TensorDict(tensors, batch_size=[len(self)]), non_tensors, meta)

    def repeat(self, times: int, interleave: bool = True) -> "Batch":
        """Each row `times` in a row (interleave: r0 r0 r1 r1) or the whole batch `times` over (r0 r1 r0 r1)."""
        if times < 1:
            raise ValueError(f"repeat times={times} must be >= 1")
        rows = torch.arange(len(self))
        return self[rows.repeat_interleave(times) if interleave else rows.repeat(times)]

    def chunk(self, num_chunks: int) -> list["Batch"]:
        """`num_chunks` equal parts, in order."""
        if num_chunks < 1 or len(self) % num_chunks:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {num_chunks} equal parts; call pad_to_multiple({num_chunks}) "
                "first and unpad() after concatenating the results"
            )
        return self.split(len(self) // num_chunks)

    def split(self, split_size: int | Sequence[int]) -> list["Batch"]:
        """Like torch.split: parts of `split_size` rows (the last may be shorter), or of the listed sizes."""
        if isinstance(split_size, int):
            if split_size < 1:
                raise ValueError(f"split_size={split_size} must be >= 1")
            sizes = [min(split_size, len(self) - s) for s in range(0, len(self), split_size)]
        else:
            sizes = list(split_size)
            if sum(sizes) != len(self) or min(sizes, default=0) < 0:
                raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the batch size {len(self)}")
        starts = np.cumsum([0, *sizes])
        return [self[int(a) : int(b)] for a, b in itertools.pairwise(starts)]

    def pad_to_multiple(self, divisor: int) -> "Batch":
        """Append copies of the first rows (cyclically) until B divides by `divisor`; records meta['num_padding']."""
        if divisor < 1:
            raise ValueError(f"divisor={divisor} must be >= 1")
        if PAD_KEY in self.meta:
            raise ValueError("batch is already padded; unpad() it first")
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        pad = -len(self) % divisor
        padded = self[torch.arange(len(self) + pad) % len(self)]
        padded.meta[PAD_KEY] = pad
        return padded

    def unpad(self) -> "Batch":
        """Drop the rows pad_to_multiple added and its meta entry."""
        if PAD_KEY not in self.meta:
            raise ValueError("batch was not padded by pad_to_multiple")
        out = self[: len(self) - self.meta[PAD_KEY]]
        del out.meta[PAD_KEY]
        return out

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order. Keys must match; meta values must be equal across batches."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], 1):
            if set(b.tensor_keys) != set(first.tensor_keys) or set(b.non_tensor_keys) != set(first.non_tensor_keys):
                diff = sorted(set(b.keys()) ^ set(first.keys()))
                raise ValueError(f"concat: batch {i} has different keys from batch 0: {diff}")
            for key in first.tensor_keys:
                if b.tensors[key].shape[1:] != first.tensors[key].shape[1:]:
                    raise ValueError(
                        f"concat: tensor {key!r} of batch {i} has row shape {tuple(b.tensors[key].shape[1:])}, "
                        f"batch 0 has {tuple(first.tensors[key].shape[1:])}"
                    )
        meta: dict[str, Any] = {}
        for i, b in enumerate(batches):
            for key, value in b.meta.items():
                if key == PAD_KEY:
                    raise ValueError(f"concat: batch {i} is padded; concatenate the chunks first, then unpad()")
                if key in meta and not _same(meta[key], value):
                    raise ValueError(f"concat: meta {key!r} of batch {i} differs from earlier batches")
                meta[key] = value
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensor_keys}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensor_keys}
        size = sum(len(b) for b in batches)
        return Batch(TensorDict(tensors, batch_size=[size]), non_tensors, meta)

    def iter_mini_batches(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = True, seed: int = 0
    ) -> Iterator["Batch"]:
        """B // mini_batch_size mini-batches per epoch; epoch e is shuffled by a generator seeded seed + e."""
        if mini_batch_size < 1 or len(self) % mini_batch_size:
            raise ValueError(
                f"batch of {len(self)} rows does not divide into mini-batches of {mini_batch_size}; "
                "choose a mini-batch size that divides it"
            )
        for epoch in range(epochs):
            if shuffle:
                order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch))
            else:
                order = torch.arange(len(self))
            for rows in order.split(mini_batch_size):
                yield self[rows]

    def to(self, device: str | torch.device) -> "Batch":
        """Tensors moved to `device`; non-tensors and meta shared."""
        return Batch(self.tensors.to(device), dict(self.non_tensors), dict(self.meta))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "size": len(self),
            "tensors": {k: v.contiguous() for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = TensorDict(state["tensors"], batch_size=[state["size"]])
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]
