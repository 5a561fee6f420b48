"""Stream tensors into and out of a megatron torch_dist checkpoint, one chunk at a time, in one process.

megatron's own `dist_checkpointing.save` needs every tensor in memory at once. The converter
instead declares the chunks up front and produces each one only when the writer asks for it
(`write_chunks`), and reads back just the chunks it asks for (`read_chunks`). The files are
plain torch.distributed.checkpoint files plus megatron's `metadata.json` and `common.pt`, so
`megatron.core.dist_checkpointing.load` reads them at any TP/PP/EP.

Usage::

    chunks = [Chunk("decoder.layers.linear_fc2.weight", (0, 0, 0), (1, 64, 128), (2, 64, 128), torch.float32)]
    write_chunks(out_dir, chunks, produce=lambda chunk: tensors[chunk.offsets[0]])
    wanted = {chunk.key: (chunk.offsets, chunk.sizes)}
    layer0 = read_chunks(out_dir, wanted, {chunk.key: torch.float32})[chunk.key]
"""

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

COMMON_FILE = "common.pt"


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


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Reads the requested (offsets, sizes) slice of each key into its destination tensor."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner gives the checkpoint metadata"
        items = []
        for key, offsets in self._offsets.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if not isinstance(stored, TensorStorageMetadata):
                raise KeyError(f"{key} is not a tensor in the checkpoint")
            wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=self.state_dict[key].shape)
            items += create_read_items_for_chunk_list(key, stored, [wanted])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


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


def stored_entries(ckpt_dir: str | Path) -> StoredEntries:
    """What a torch_dist checkpoint holds, from its metadata file alone."""
    metadata = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    tensors, objects = {}, []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = (tuple(md.size), md.properties.dtype)
        else:
            objects.append(key)
    return StoredEntries(tensors, objects)


def read_chunks(
    ckpt_dir: str | Path,
    wanted: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    dtypes: dict[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Read `key → (offsets, sizes)` slices of a torch_dist checkpoint; only those bytes are loaded.

    `dtypes` are the stored dtypes (`stored_entries(ckpt_dir).tensors`), read once by the caller.
    """
    out = {key: torch.empty(sizes, dtype=dtypes[key]) for key, (_, sizes) in wanted.items()}
    planner = _SliceLoadPlanner({key: offsets for key, (offsets, _) in wanted.items()})
    with _single_process():
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(ckpt_dir)), planner=planner, no_dist=True)
    return out
