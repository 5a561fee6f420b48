"""HF safetensors ⇄ megatron torch_dist checkpoints, streamed tensor by tensor through the weight plan.

Both directions run in one process without building a model. hf → mcore declares every
checkpoint chunk (one per parameter: a layer of a stacked key, or one expert of one layer),
then fills each chunk from the HF files only when the writer reaches it. mcore → hf reads the
parameters in batches of `READ_BATCH_BYTES` and writes each HF tensor straight into its place in
its safetensors shard, so memory is one batch (or one larger parameter) whatever the depth and the
shard size. Both run torch single-threaded (`_one_thread`). The name and layout mapping is
`megarl.models.weight_map.weight_plan` (a sequence classifier's score head in place of the LM head:
`megarl.convert.classifier`); where a parameter sits in the checkpoint is `megarl.convert.dist_layout.dist_slot`.
"""

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.config.layout import stage_layer_counts
from megarl.config.training import MegatronConfig
from megarl.convert.classifier import checkpoint_plan, is_classifier
from megarl.convert.dist_layout import DistSlot, dist_slot, full_shape
from megarl.convert.hf_io import SafetensorsShardWriter, TensorEntry, copy_model_files, fill_groups
from megarl.megatron.dcp_io import Chunk, DcpReader, Slice, StoredEntries, write_chunks
from megarl.megatron.weights import SafetensorsReader
from megarl.models.param_mapping import ParamMapping
from megarl.models.quantized import quantization_problem
from megarl.models.spec import ModelSpec, load_hf_config, model_spec
from megarl.models.weight_map import padded_vocab_size

_EMBEDDING = "embedding.word_embeddings.weight"
_LISTED = 20
READ_BATCH_BYTES = 64 * 2**20
"""mcore → hf reads this many bytes of parameters per `dcp.load` call (or one larger parameter)."""


class ConversionError(ValueError):
    """The input cannot be converted; the message names the file or parameter and the fix."""


@dataclass(frozen=True, slots=True)
class ConversionStats:
    num_tensors: int
    num_bytes: int
    seconds: float
    peak_rss_bytes: int
    """Peak anonymous resident memory during the conversion above that before it (see `anon_rss_bytes`)."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / max(self.seconds, 1e-9)


def anon_rss_bytes() -> int:
    """Resident memory not backed by files. safetensors and checkpoint files are read through mmap; those
    pages are file-backed page cache the kernel can drop, so they are not what a conversion allocates."""
    import psutil

    info = psutil.Process().memory_info()
    return info.rss - info.shared


class PeakRss:
    """Peak anonymous RSS above the RSS at the start, sampled whenever `sample` is called (once per tensor)."""

    def __init__(self) -> None:
        self.start = anon_rss_bytes()
        self.peak = self.start

    def sample(self) -> None:
        self.peak = max(self.peak, anon_rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops on one thread. Every op here is a memory copy, which a second intra-op thread barely
    speeds up, while on a busy host each parallel copy waits for that thread to be scheduled: ~10 ms per
    copy measured on 2 shared cores, half the mcore → hf time of the MoE bench and 5× its CPU time. On
    the same machine idle, mcore → hf took as long either way and hf → mcore ~5% longer, with less CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", … ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")


def spec_of(hf_dir: str | Path) -> ModelSpec:
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file} does not exist: point at a Hugging Face model directory")
    refuse_quantized(hf_dir)
    try:
        return model_spec(load_hf_config(hf_dir))
    except ValueError as err:
        raise ConversionError(f"{config_file}: {err}") from err


def refuse_quantized(hf_dir: str | Path) -> None:
    """A `quantization_config` checkpoint (fp8 and others) is refused by name (`megarl.models.quantized`)."""
    if problem := quantization_problem(hf_dir):
        raise ConversionError(problem)


@dataclass(frozen=True)
class Stages:
    """A pipeline split: `pp` stages, the first and last with a layer count of their own where set (the trainer's
    `<role>.megatron.num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`)."""

    pp: int = 1
    first: int | None = None
    last: int | None = None

    def problem(self, num_layers: int) -> str | None:
        """Why `num_layers` cannot be split this way, or None."""
        if self.first is None and self.last is None:
            if num_layers % self.pp:
                return (
                    f"--pp {self.pp} must divide the {num_layers} layers; or set --first-stage-layers / "
                    "--last-stage-layers"
                )
            return None
        mp = MegatronConfig(
            pipeline_model_parallel_size=self.pp,
            num_layers_in_first_pipeline_stage=self.first,
            num_layers_in_last_pipeline_stage=self.last,
        )
        counts = stage_layer_counts(mp, num_layers)
        if self.pp > 1 and sum(counts) == num_layers and min(counts) >= 1:
            return None
        return (
            f"--pp {self.pp} --first-stage-layers {self.first} --last-stage-layers {self.last} split the "
            f"{num_layers} layers as {counts}: every stage needs a layer and the stages between first and last "
            "an equal share of the rest"
        )


def check_layout(spec: ModelSpec, tp: int, stages: Stages, ep: int) -> None:
    """Raise if the model cannot be split this way (the layout a checkpoint will be trained at)."""
    problems = []
    pp = stages.pp
    if min(tp, pp, ep) < 1:
        problems.append(f"--tp {tp} --pp {pp} --ep {ep}: sizes must be >= 1")
    elif spec.num_heads % tp or spec.num_kv_heads % tp:
        problems.append(f"--tp {tp} must divide the {spec.num_heads} attention heads and {spec.num_kv_heads} KV heads")
    if pp >= 1 and (problem := stages.problem(spec.num_layers)):
        problems.append(problem)
    if ep > 1 and not spec.is_moe:
        problems.append(f"--ep {ep} needs a mixture-of-experts model; {spec.model_type} is dense")
    elif spec.is_moe and ep >= 1 and spec.num_experts % ep:
        problems.append(f"--ep {ep} must divide the {spec.num_experts} experts")
    if problems:
        raise ConversionError("; ".join(problems))


def _check_hf_names(spec: ModelSpec, plan: dict[str, ParamMapping], reader: SafetensorsReader, hf_dir: Path) -> None:
    wanted = {name: shape for m in plan.values() for name, shape in zip(m.hf_names, m.hf_shapes, strict=True)}
    on_disk = set(reader.names())
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    mtp_layers = tuple(f"model.layers.{spec.num_layers + i}." for i in range(spec.num_mtp_layers))
    missing = sorted(set(wanted) - on_disk)
    extra = sorted(name for name in on_disk - set(wanted) - ignorable if not name.startswith(mtp_layers))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors the config implies: {listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} tensors the {spec.model_type} mapping does not know: {listed(extra)}")
    mismatched = [
        f"{name} {reader.shape(name)} (config implies {shape})"
        for name, shape in wanted.items()
        if name in on_disk and reader.shape(name) != shape
    ]
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {listed(mismatched)}")
    if problems:
        raise ConversionError(f"{hf_dir}: " + "; ".join(problems))


def replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def fresh_tmp(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def hf_to_mcore(
    hf_dir: str | Path, out_dir: str | Path, tp: int = 1, stages: Stages = Stages(), ep: int = 1
) -> ConversionStats:
    """Write `hf_dir`'s weights as a torch_dist checkpoint (vocabulary padded for `tp`).

    The checkpoint loads at any layout with the same vocabulary padding; `tp`/`stages`/`ep` are
    checked against the model so a layout that cannot work fails here rather than at load. A sequence
    classifier's `score.weight` becomes the value head `output_layer.weight` (`megarl.convert.classifier`).
    """
    hf, out = Path(hf_dir), Path(out_dir)
    spec = spec_of(hf)
    check_layout(spec, tp, stages, ep)
    reader = SafetensorsReader(hf)
    plan = checkpoint_plan(spec, padded_vocab_size(spec.vocab_size, tp), is_classifier(hf))
    _check_hf_names(spec, plan, reader, hf)
    rss = PeakRss()
    start = time.perf_counter()
    chunks: list[Chunk] = []
    sources: dict[tuple[str, tuple[int, ...]], ParamMapping] = {}
    for mapping in plan.values():
        slot = dist_slot(mapping.mcore_name, spec)
        shape = full_shape(mapping)
        dtype = reader.dtype(mapping.hf_names[0])
        chunk = Chunk(slot.key, slot.offsets(len(shape)), slot.sizes(shape), slot.global_shape(shape), dtype)
        chunks.append(chunk)
        sources[(chunk.key, chunk.offsets)] = mapping

    def produce(chunk: Chunk) -> torch.Tensor:
        mapping = sources[(chunk.key, chunk.offsets)]
        tensor = mapping.merge([reader.get(name) for name in mapping.hf_names])
        rss.sample()
        return tensor

    tmp = fresh_tmp(out)
    with _one_thread():
        write_chunks(tmp, chunks, produce)
    replace_dir(tmp, out)
    rss.sample()
    num_bytes = sum(torch.Size(c.sizes).numel() * c.dtype.itemsize for c in chunks)
    return ConversionStats(len(chunks), num_bytes, time.perf_counter() - start, rss.growth)


def _stored_plan(spec: ModelSpec, stored: StoredEntries, mcore: Path, classifier: bool) -> dict[str, ParamMapping]:
    """The weight plan matching the checkpoint's vocabulary padding, after checking keys and shapes."""
    tensors = stored.tensors
    if _EMBEDDING not in tensors:
        raise ConversionError(f"{mcore} has no {_EMBEDDING}: not a megatron GPT checkpoint")
    plan = checkpoint_plan(spec, tensors[_EMBEDDING][0][0], classifier)
    expected: dict[str, tuple[int, ...]] = {}
    for mapping in plan.values():
        slot = dist_slot(mapping.mcore_name, spec)
        expected[slot.key] = slot.global_shape(full_shape(mapping))
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    mismatched = [
        f"{key} {tensors[key][0]} (config implies {shape})"
        for key, shape in expected.items()
        if key in tensors and tensors[key][0] != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} keys: {listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} keys the {spec.model_type} mapping does not know: {listed(extra)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {listed(mismatched)}")
    if problems:
        raise ConversionError(f"{mcore} does not match the HF config: " + "; ".join(problems))
    return plan


@dataclass(frozen=True, slots=True)
class _Export:
    """One parameter to read from the checkpoint and write as its HF tensors."""

    mapping: ParamMapping
    piece: Slice
    shape: tuple[int, ...]
    """The full (TP=1) mcore shape."""
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def hf_entries(self) -> list[TensorEntry]:
        names, shapes = self.mapping.hf_names, self.mapping.hf_shapes
        return [TensorEntry(name, shape, self.dtype) for name, shape in zip(names, shapes, strict=True)]


def _exports(spec: ModelSpec, reader: DcpReader, mcore: Path, classifier: bool) -> list[_Export]:
    """Every parameter, in HF order: the embedding, each decoder layer, then the final norm and head."""
    groups: list[list[_Export]] = [[] for _ in range(spec.num_layers + 2)]
    for mapping in _stored_plan(spec, reader.entries, mcore, classifier).values():
        slot = dist_slot(mapping.mcore_name, spec)
        shape = full_shape(mapping)
        piece = Slice(slot.key, slot.offsets(len(shape)), slot.sizes(shape))
        export = _Export(mapping, piece, shape, reader.entries.tensors[slot.key][1])
        groups[_group(mapping, slot)].append(export)
    return [export for group in groups for export in group]


def _group(mapping: ParamMapping, slot: DistSlot) -> int:
    if slot.layer is not None:
        return 1 + slot.layer
    return 0 if mapping.mcore_name == _EMBEDDING else -1


def _batch_tensors(reader: DcpReader, batch: list[_Export]) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = reader.read([export.piece for export in batch])
    for export, tensor in zip(batch, tensors, strict=True):
        yield from zip(export.mapping.hf_names, export.mapping.split(tensor.reshape(export.shape)), strict=True)


def _hf_tensors(reader: DcpReader, exports: list[_Export]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor), `READ_BATCH_BYTES` of parameters read at a time; a batch's tensors are let go
    (`_batch_tensors` returns) before the next batch is read."""
    for batch in fill_groups(exports, READ_BATCH_BYTES):
        yield from _batch_tensors(reader, batch)


def iter_hf_tensors(
    spec: ModelSpec, mcore_dir: str | Path, classifier: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of a checkpoint, reading `READ_BATCH_BYTES` of parameters at a time;
    `classifier`: its head is a sequence classifier's (`score.weight`)."""
    reader = DcpReader(mcore_dir)
    yield from _hf_tensors(reader, _exports(spec, reader, Path(mcore_dir), classifier))


def mcore_to_hf(
    mcore_dir: str | Path, hf_config_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 2**30
) -> ConversionStats:
    """Write a torch_dist checkpoint as sharded safetensors, with the config and tokenizer of `hf_config_dir`
    (a `*ForSequenceClassification` config: the value head as `score.weight`)."""
    mcore, out = Path(mcore_dir), Path(out_dir)
    if not (mcore / "metadata.json").is_file():
        raise ConversionError(f"{mcore} is not a megatron dist checkpoint (no metadata.json)")
    spec = spec_of(hf_config_dir)
    rss = PeakRss()
    start = time.perf_counter()
    reader = DcpReader(mcore, reuse_buffer=True)  # each tensor is written before the next batch is read
    exports = _exports(spec, reader, mcore, is_classifier(hf_config_dir))
    tmp = fresh_tmp(out)
    entries = [entry for export in exports for entry in export.hf_entries()]
    with _one_thread(), SafetensorsShardWriter(tmp, entries, max_shard_bytes) as writer:
        for name, tensor in _hf_tensors(reader, exports):
            writer.write(name, tensor)
            rss.sample()
    copy_model_files(hf_config_dir, tmp)
    replace_dir(tmp, out)
    rss.sample()
    return ConversionStats(len(entries), writer.total_bytes, time.perf_counter() - start, rss.growth)
