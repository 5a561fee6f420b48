"""Write a Hugging Face model directory: sharded safetensors with an index, plus config and tokenizer files.

`SafetensorsShardWriter` is told every tensor's name, shape and dtype up front, so it knows each
shard's header and each tensor's offset before any data arrives. Each tensor is written to its
place in its shard file as it arrives and nothing is kept, so memory does not depend on the shard
size. A shard is written under a temporary name and renamed once its last tensor is in, so a killed
conversion never leaves a complete-looking shard.

Usage::

    entries = [TensorEntry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    with SafetensorsShardWriter(out_dir, entries, max_shard_bytes=2**30) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    copy_model_files(hf_config_dir, out_dir)
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol, TypeVar

import torch

COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_HEADER_ALIGN = 8  # safetensors pads the JSON header with spaces to this (safetensors/src/tensor.rs `prepare`)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


SizedT = TypeVar("SizedT", bound=_Sized)


def fill_groups(items: list[SizedT], max_bytes: int) -> list[list[SizedT]]:
    """Consecutive items in groups of at most `max_bytes` (a larger item gets a group of its own)."""
    groups: list[list[SizedT]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return groups if groups[-1] else []


def _header(entries: list[TensorEntry]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header of one shard and each tensor's offset in the file.

    The data is laid out by descending dtype size (stable), as safetensors' own writer does
    (tensor.rs `prepare`), so every tensor is aligned to its dtype; offsets are contiguous from 0,
    which is what its reader checks (tensor.rs `Metadata::validate`).
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, position = {}, 0
    for entry in sorted(entries, key=lambda e: -e.dtype.itemsize):
        if entry.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} is not one of {list(_DTYPE_NAMES)}")
        header[entry.name] = {
            "dtype": _DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [position, position + entry.nbytes],
        }
        offsets[entry.name] = position
        position += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    data_start = 8 + len(text)
    prefix = len(text).to_bytes(8, "little") + text
    return prefix, {name: data_start + offset for name, offset in offsets.items()}


class _OpenShard:
    """One shard file being filled: its header is written on open, each tensor at its own offset."""

    def __init__(self, path: Path, entries: list[TensorEntry]) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        prefix, self.offsets = _header(entries)
        self.remaining = len(entries)
        self.file: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115 - closed in `finish`, when the last tensor is in
        self.file.write(prefix)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.file.seek(self.offsets[name])
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.remaining -= 1

    def finish(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)


class SafetensorsShardWriter:
    def __init__(self, out_dir: str | Path, entries: list[TensorEntry], max_shard_bytes: int = 2**30) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shards = fill_groups(entries, max_shard_bytes)
        self._entries = {entry.name: (i, entry) for i, shard in enumerate(self.shards) for entry in shard}
        if len(self._entries) != len(entries):
            raise ValueError(f"{len(entries) - len(self._entries)} tensor names are declared twice")
        self._open: dict[int, _OpenShard] = {}
        self.num_finished = 0
        """Shards complete and renamed into place so far."""
        self.total_bytes = sum(entry.nbytes for entry in entries)

    def file_name(self, index: int) -> str:
        return f"model-{index + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one declared tensor to its shard; the shard is renamed into place when it is complete."""
        if name not in self._entries:
            raise ValueError(f"{name} was not declared, or was written twice")
        index, entry = self._entries[name]
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, declared {entry.shape} {entry.dtype}")
        del self._entries[name]
        if index not in self._open:
            self._open[index] = _OpenShard(self.out / self.file_name(index), self.shards[index])
        shard = self._open[index]
        shard.write(name, tensor)
        if shard.remaining == 0:
            self._open.pop(index).finish()
            self.num_finished += 1

    def close(self) -> None:
        """Check that every declared tensor was written and write the index."""
        if self._entries:
            raise ValueError(f"{len(self._entries)} declared tensors were not written: {sorted(self._entries)[:5]}")
        weight_map = {entry.name: self.file_name(i) for i, shard in enumerate(self.shards) for entry in shard}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = self.out / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, self.out / INDEX_FILE)

    def __enter__(self) -> "SafetensorsShardWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        for shard in self._open.values():
            shard.file.close()


def copy_model_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the config, generation config and tokenizer files that `src_dir` has; returns their names."""
    src = Path(src_dir)
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, Path(out_dir) / name)
            copied.append(name)
    return copied
