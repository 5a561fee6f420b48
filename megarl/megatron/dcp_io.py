"""Stream tensors into and out of a megatron torch_dist checkpoint, one chunk at a time, in one process.

megatron's own `dist_checkpointing.save` needs every tensor in memory at once. The converter
instead declares the chunks up front and produces each one only when the writer asks for it
(`write_chunks`), and reads back just the slices it asks for (`DcpReader.read`). The files are
plain torch.distributed.checkpoint files plus megatron's `metadata.json` and `common.pt`, so
`megatron.core.dist_checkpointing.load` reads them at any TP/PP/EP.

Usage::

    chunks = [Chunk("decoder.layers.linear_fc2.weight", (0, 0, 0), (1, 64, 128), (2, 64, 128), torch.float32)]
    write_chunks(out_dir, chunks, produce=lambda chunk: tensors[chunk.offsets[0]])
    (layer0,) = DcpReader(out_dir).read([Slice(chunk.key, chunk.offsets, chunk.sizes)])
"""

import io
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

COMMON_FILE = "common.pt"
_ALIGN = 64


@contextmanager
def _single_process() -> Iterator[None]:
    """torch.distributed.checkpoint warns that it runs without a process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass(frozen=True, slots=True)
class Chunk:
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype


class _StreamingSavePlanner(DefaultSavePlanner):
    """Declares the chunks as write items and asks `produce` for each one as it is written."""

    def __init__(self, chunks: list[Chunk], produce: Callable[[Chunk], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offsets): c for c in chunks}
        self._produce = produce

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in self._chunks.values()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        assert write_item.index.offset is not None
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = self._produce(chunk)
        expected = torch.Size(chunk.sizes).numel()
        if tensor.numel() != expected or tensor.dtype != chunk.dtype:
            raise ValueError(
                f"{chunk.key} at {chunk.offsets}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                f"declared {chunk.sizes} {chunk.dtype}"
            )
        return tensor.contiguous().reshape(chunk.sizes)


def write_chunks(out_dir: str | Path, chunks: list[Chunk], produce: Callable[[Chunk], torch.Tensor]) -> None:
    """Write a torch_dist checkpoint holding `chunks`; `produce(chunk)` makes each chunk's data when needed.

    The chunks of one key must tile its global shape exactly.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1)
    with _single_process():
        dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(chunks, produce), no_dist=True)
    torch.save({}, out / COMMON_FILE)
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(out))


@dataclass(frozen=True, slots=True)
class StoredEntries:
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Tensor key → (global shape, dtype)."""
    objects: list[str]
    """Keys of the pickled (non-tensor) entries, e.g. megatron's `_extra_state` objects."""


def _entries(metadata: Metadata) -> StoredEntries:
    tensors, objects = {}, []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = (tuple(md.size), md.properties.dtype)
        else:
            objects.append(key)
    return StoredEntries(tensors, objects)


def stored_entries(ckpt_dir: str | Path) -> StoredEntries:
    """What a torch_dist checkpoint holds, from its metadata file alone."""
    return _entries(dcp.FileSystemReader(str(ckpt_dir)).read_metadata())


@dataclass(frozen=True, slots=True)
class Slice:
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _DirectReads(dcp.FileSystemReader):
    """A FileSystemReader that reads each chunk's bytes straight into the tensor they load into.

    `FileSystemReader.read_data` (filesystem.py) `torch.load`s every stored chunk it touches into a
    fresh tensor, then copies the overlap out: the whole chunk allocated (page faults included) and
    copied once more. Here `torch.load` with `map_location="meta"` reads only the chunk's pickle, which
    gives its layout and, as `_checkpoint_offset`, where its data starts (serialization.py
    `_load.load_tensor`, the way `_experimental/checkpoint_reader.py` `_partial_read` reads a tensor);
    when the overlap is contiguous in the file and in the destination, it is read into the destination
    with one `readinto`. Other items take the upstream path. The metadata file is unpickled once:
    `dcp.load` asks for it on every call (state_dict_loader.py `_load_state_dict`).
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.metadata = super().read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        upstream: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR and not info.transform_descriptors:
                per_file.setdefault(info.relative_path, []).append(item)
            else:
                upstream.append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                file = cast(io.BufferedIOBase, stream)  # `open(path, "rb")` (filesystem.py `FileSystem.create_stream`)
                upstream += [item for item in items if not self._read_into(file, item, planner)]
        return super().read_data(LoadPlan(upstream), planner)

    def _read_into(self, stream: io.BufferedIOBase, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read one item straight into its destination; False if it is not contiguous on both sides."""
        info = self.storage_data[item.storage_index]
        stored = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
        source = _narrow(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        assert target.shape == source.shape, f"{item.storage_index}: {target.shape} vs {source.shape}"
        data_offset = stored.untyped_storage()._checkpoint_offset
        if data_offset is None or not (source.is_contiguous() and target.is_contiguous()):
            return False
        stream.seek(info.offset + data_offset + source.storage_offset() * source.element_size())
        destination = target.reshape(-1).view(torch.uint8).numpy().data
        if stream.readinto(destination) != destination.nbytes:
            raise OSError(f"{info.relative_path}: short read of {item.storage_index.fqn}")
        planner.commit_tensor(item, target)
        return True


class _ChunkIndex:
    """The stored chunks of one key, found by their offsets on the leading axes where every chunk has size 1
    (the layer and expert axes of a stacked key), so a slice is matched against the chunks at its own layer
    and expert only: torch's resharding sweep visits every chunk it is given (planner_helpers.py
    `create_read_items_for_chunk_list`), which per slice would be quadratic in layers × experts."""

    def __init__(self, chunks: list[ChunkStorageMetadata], ndim: int) -> None:
        self.chunks = chunks
        self.num_axes = 0
        while self.num_axes < ndim and all(c.sizes[self.num_axes] == 1 for c in chunks):
            self.num_axes += 1
        self.by_prefix: dict[tuple[int, ...], list[ChunkStorageMetadata]] = {}
        for chunk in chunks:
            self.by_prefix.setdefault(tuple(chunk.offsets[: self.num_axes]), []).append(chunk)

    def overlapping(self, piece: Slice) -> list[ChunkStorageMetadata]:
        if all(size == 1 for size in piece.sizes[: self.num_axes]):
            return self.by_prefix.get(piece.offsets[: self.num_axes], [])
        return self.chunks


class _TargetsLoadPlanner(DefaultLoadPlanner):
    """Loads precomputed read items into one target tensor per slice (keyed by key and offsets)."""

    def __init__(self, items: list[ReadItem], targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._targets = targets

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return self._targets[(index.fqn, tuple(index.offset))]


class DcpReader:
    """Reads slices of a torch_dist checkpoint; one reader serves many `read` calls.

    Each call loads only the stored chunks its slices overlap, through `dcp.load` with a plan of
    torch's resharding read items. Memory is the slices' tensors plus one stored chunk at a time
    (filesystem.py `FileSystemReader.read_data` loads a chunk, then copies the overlap out).
    With `reuse_buffer`, the slices of every call are laid out in one buffer that the next call
    overwrites: the kernel zeroes each page a fresh allocation touches, which costs about as much
    as the copy into it, and a buffer that stays allocated pays that once.
    """

    def __init__(self, ckpt_dir: str | Path, reuse_buffer: bool = False) -> None:
        self._storage = _DirectReads(str(ckpt_dir))
        self.entries = _entries(self._storage.metadata)
        self._index: dict[str, _ChunkIndex] = {}
        self._buffer = torch.empty(0, dtype=torch.uint8) if reuse_buffer else None

    def _stored(self, key: str) -> TensorStorageMetadata:
        stored = self._storage.metadata.state_dict_metadata.get(key)
        if not isinstance(stored, TensorStorageMetadata):
            raise KeyError(f"{key} is not a tensor in the checkpoint")
        return stored

    def _read_items(self, key: str, pieces: list[Slice]) -> list[ReadItem]:
        stored = self._stored(key)
        if key not in self._index:
            self._index[key] = _ChunkIndex(stored.chunks, len(stored.size))
        index = self._index[key]
        candidates = list({id(c): c for piece in pieces for c in index.overlapping(piece)}.values())
        wanted = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in pieces]
        narrowed = TensorStorageMetadata(stored.properties, stored.size, candidates)
        return create_read_items_for_chunk_list(key, narrowed, wanted)

    def _targets(self, pieces: list[Slice]) -> list[torch.Tensor]:
        """A tensor per slice: fresh, or laid end to end (64-byte aligned) in the reused buffer."""
        dtypes = [self._stored(p.key).properties.dtype for p in pieces]
        if self._buffer is None:
            return [torch.empty(p.sizes, dtype=dtype) for p, dtype in zip(pieces, dtypes, strict=True)]
        sizes = [torch.Size(p.sizes).numel() * dtype.itemsize for p, dtype in zip(pieces, dtypes, strict=True)]
        starts = [0, *itertools.accumulate(-(-n // _ALIGN) * _ALIGN for n in sizes)]
        if starts[-1] > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # let the old one go before allocating the new one
            self._buffer = torch.empty(starts[-1], dtype=torch.uint8)
        views = zip(pieces, dtypes, starts, sizes, strict=False)
        return [self._buffer[start : start + n].view(dtype).view(p.sizes) for p, dtype, start, n in views]

    def read(self, pieces: list[Slice]) -> list[torch.Tensor]:
        """The slices' tensors, in order; only the bytes of the stored chunks they overlap are read."""
        by_key: dict[str, list[Slice]] = {}
        for piece in pieces:
            by_key.setdefault(piece.key, []).append(piece)
        items = [item for key, group in by_key.items() for item in self._read_items(key, group)]
        tensors = self._targets(pieces)
        targets = {(p.key, p.offsets): tensor for p, tensor in zip(pieces, tensors, strict=True)}
        with _single_process():
            dcp.load({}, storage_reader=self._storage, planner=_TargetsLoadPlanner(items, targets), no_dist=True)
        return tensors
