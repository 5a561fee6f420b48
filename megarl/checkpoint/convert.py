"""HF safetensors ⇄ megatron torch_dist checkpoints, streamed tensor by tensor through the weight plan.

Both directions run in one process without building a model. hf → mcore declares every
checkpoint chunk (one per parameter: a layer of a stacked key, or one expert of one layer),
then fills each chunk from the HF files only when the writer reaches it. mcore → hf reads one
decoder layer at a time and writes sharded safetensors. The name and layout mapping is
`megarl.models.weight_map.weight_plan`; where a parameter sits in the checkpoint is
`megarl.checkpoint.layout.dist_slot`.
"""

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.checkpoint.dcp_io import Chunk, read_chunks, stored_entries, write_chunks
from megarl.checkpoint.hf_io import ShardedSafetensorsWriter, copy_model_files
from megarl.checkpoint.layout import DistSlot, dist_slot, full_shape
from megarl.megatron.weights import SafetensorsReader
from megarl.models.spec import ModelSpec, load_hf_config, model_spec
from megarl.models.weight_map import ParamMapping, padded_vocab_size, weight_plan

_EMBEDDING = "embedding.word_embeddings.weight"
_LISTED = 20


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


class _PeakRss:
    """Peak anonymous RSS above the RSS at the start, sampled whenever `sample` is called (once per tensor)."""

    def __init__(self) -> None:
        self.start = anon_rss_bytes()
        self.peak = self.start

    def sample(self) -> None:
        self.peak = max(self.peak, anon_rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", … ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")


def spec_of(hf_dir: str | Path) -> ModelSpec:
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file} does not exist: point at a Hugging Face model directory")
    try:
        return model_spec(load_hf_config(hf_dir))
    except ValueError as err:
        raise ConversionError(f"{config_file}: {err}") from err


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int) -> None:
    """Raise if the model cannot be split this way (the layout a checkpoint will be trained at)."""
    problems = []
    if min(tp, pp, ep) < 1:
        problems.append(f"--tp {tp} --pp {pp} --ep {ep}: sizes must be >= 1")
    elif spec.num_heads % tp or spec.num_kv_heads % tp:
        problems.append(f"--tp {tp} must divide the {spec.num_heads} attention heads and {spec.num_kv_heads} KV heads")
    if pp >= 1 and spec.num_layers % pp:
        problems.append(f"--pp {pp} must divide the {spec.num_layers} layers")
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
        problems.append(f"missing {len(missing)} tensors the config implies: {_listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} tensors the {spec.model_type} mapping does not know: {_listed(extra)}")
    mismatched = [
        f"{name} {reader.shape(name)} (config implies {shape})"
        for name, shape in wanted.items()
        if name in on_disk and reader.shape(name) != shape
    ]
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_listed(mismatched)}")
    if problems:
        raise ConversionError(f"{hf_dir}: " + "; ".join(problems))


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _fresh_tmp(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1) -> ConversionStats:
    """Write `hf_dir`'s weights as a torch_dist checkpoint (vocabulary padded for `tp`).

    The checkpoint loads at any layout with the same vocabulary padding; `tp`/`pp`/`ep` are
    checked against the model so a layout that cannot work fails here rather than at load.
    """
    hf, out = Path(hf_dir), Path(out_dir)
    spec = spec_of(hf)
    check_layout(spec, tp, pp, ep)
    reader = SafetensorsReader(hf)
    plan = weight_plan(spec, padded_vocab_size(spec.vocab_size, tp))
    _check_hf_names(spec, plan, reader, hf)
    rss = _PeakRss()
    start = time.perf_counter()
    chunks: list[Chunk] = []
    sources: dict[tuple[str, tuple[int, ...]], ParamMapping] = {}
    for mapping in plan.values():
        slot = dist_slot(mapping.mcore_name, spec)
        shape = full_shape(mapping)
        dtype = reader.dtype(mapping.hf_names[0])
        chunk = Chunk(
            slot.key, slot.offsets(len(shape)), (1,) * len(slot.prefix) + shape, slot.global_shape(shape), dtype
        )
        chunks.append(chunk)
        sources[(chunk.key, chunk.offsets)] = mapping

    def produce(chunk: Chunk) -> torch.Tensor:
        mapping = sources[(chunk.key, chunk.offsets)]
        tensor = mapping.merge([reader.get(name) for name in mapping.hf_names])
        rss.sample()
        return tensor

    tmp = _fresh_tmp(out)
    write_chunks(tmp, chunks, produce)
    _replace_dir(tmp, out)
    rss.sample()
    num_bytes = sum(torch.Size(c.sizes).numel() * c.dtype.itemsize for c in chunks)
    return ConversionStats(len(chunks), num_bytes, time.perf_counter() - start, rss.growth)


def _stored_plan(spec: ModelSpec, mcore: Path) -> tuple[dict[str, ParamMapping], dict[str, torch.dtype]]:
    """The weight plan matching the checkpoint's vocabulary padding, after checking keys and shapes,
    and the stored dtype of every key."""
    stored = stored_entries(mcore).tensors
    if _EMBEDDING not in stored:
        raise ConversionError(f"{mcore} has no {_EMBEDDING}: not a megatron GPT checkpoint")
    plan = weight_plan(spec, padded_vocab_size=stored[_EMBEDDING][0][0])
    expected: dict[str, tuple[int, ...]] = {}
    for mapping in plan.values():
        slot = dist_slot(mapping.mcore_name, spec)
        expected[slot.key] = slot.global_shape(full_shape(mapping))
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    mismatched = [
        f"{key} {stored[key][0]} (config implies {shape})"
        for key, shape in expected.items()
        if key in stored and stored[key][0] != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} keys: {_listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} keys the {spec.model_type} mapping does not know: {_listed(extra)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_listed(mismatched)}")
    if problems:
        raise ConversionError(f"{mcore} does not match the HF config: " + "; ".join(problems))
    return plan, {key: dtype for key, (_, dtype) in stored.items()}


def _by_layer(spec: ModelSpec, plan: dict[str, ParamMapping]) -> list[list[tuple[ParamMapping, DistSlot]]]:
    """Mappings grouped for reading: the embedding, each decoder layer, then the final norm and head."""
    groups: list[list[tuple[ParamMapping, DistSlot]]] = [[] for _ in range(spec.num_layers + 2)]
    for mapping in plan.values():
        slot = dist_slot(mapping.mcore_name, spec)
        if slot.layer is not None:
            groups[1 + slot.layer].append((mapping, slot))
        else:
            groups[0 if mapping.mcore_name == _EMBEDDING else -1].append((mapping, slot))
    return groups


def iter_hf_tensors(spec: ModelSpec, mcore_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of a checkpoint, reading one decoder layer at a time."""
    mcore = Path(mcore_dir)
    plan, dtypes = _stored_plan(spec, mcore)
    for group in _by_layer(spec, plan):
        wanted: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for mapping, slot in group:
            shape = full_shape(mapping)
            if slot.expert is not None:
                wanted[slot.key] = slot.experts_block(shape)
            else:
                wanted[slot.key] = (slot.offsets(len(shape)), (1,) * len(slot.prefix) + shape)
        blocks = read_chunks(mcore, wanted, dtypes)
        for mapping, slot in group:
            block = blocks[slot.key]
            if slot.expert is not None:
                full = block.reshape(spec.num_experts, *full_shape(mapping))[slot.expert]
            else:
                full = block.reshape(full_shape(mapping))
            yield from zip(mapping.hf_names, mapping.split(full), strict=True)


def mcore_to_hf(
    mcore_dir: str | Path, hf_config_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 2**30
) -> ConversionStats:
    """Write a torch_dist checkpoint as sharded safetensors, with the config and tokenizer of `hf_config_dir`."""
    mcore, out = Path(mcore_dir), Path(out_dir)
    if not (mcore / "metadata.json").is_file():
        raise ConversionError(f"{mcore} is not a megatron dist checkpoint (no metadata.json)")
    spec = spec_of(hf_config_dir)
    rss = _PeakRss()
    start = time.perf_counter()
    tmp = _fresh_tmp(out)
    num_tensors = 0
    with ShardedSafetensorsWriter(tmp, max_shard_bytes) as writer:
        for name, tensor in iter_hf_tensors(spec, mcore):
            # a slice of a layer's block would keep the whole block alive in the pending shard
            owns_storage = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            writer.add(name, tensor if owns_storage else tensor.clone())
            num_tensors += 1
            rss.sample()
    copy_model_files(hf_config_dir, tmp)
    _replace_dir(tmp, out)
    rss.sample()
    return ConversionStats(num_tensors, writer.total_bytes, time.perf_counter() - start, rss.growth)
