"""LoRA adapters out of megarl: a LoRA actor's trainer checkpoint as a PEFT adapter folder, or merged into its base.

A LoRA actor's trainer checkpoint (`<run>/checkpoints/global_step_N/actor/model/`) holds the adapters only, each
factor at full size under its PEFT name (`base_model.model.<hf module>.lora_A.weight` `[r, in]`, `lora_B.weight`
`[out, r]`: `megarl.lora.model`); the frozen base is the run's `model.path`. The rank is A's rows; alpha (the
update is (alpha / r)·B·A) is `actor.lora.alpha` in the `config.yaml` that `megarl-train` writes into the run
directory, or given. The merge streams the base tensor by tensor into sharded safetensors (`hf_io`), so memory is
the adapter plus about one base tensor in fp32.

Usage::

    lora_to_peft(ckpt, "adapter/", base_dir="Qwen2.5-7B/")  # then PeftModel.from_pretrained(base, "adapter/")
    merge_lora(ckpt, "Qwen2.5-7B/", "merged/")  # `ckpt` may also be a PEFT adapter folder
"""

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from megarl.config.lora import LoraConfig
from megarl.convert.hf_io import SafetensorsShardWriter, TensorEntry, copy_model_files
from megarl.convert.stream import (
    ConversionError,
    ConversionStats,
    PeakRss,
    fresh_tmp,
    listed,
    refuse_quantized,
    replace_dir,
)
from megarl.lora.peft_io import CONFIG_FILE, adapter_config, read_peft, save_peft
from megarl.megatron.dcp_io import DcpReader, Slice
from megarl.megatron.weights import SafetensorsReader

RUN_CONFIG = "config.yaml"
_FACTOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight")


@dataclass(frozen=True, slots=True)
class Factors:
    """One adapted module's factors at full size."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.b.shape[0], self.a.shape[1]


def by_weight(tensors: Mapping[str, torch.Tensor], source: Path) -> dict[str, Factors]:
    """PEFT-named factors grouped by the HF weight they adapt (`model.layers.0.self_attn.q_proj.weight`)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for name, tensor in tensors.items():
        match = _FACTOR.fullmatch(name)
        if match is None:
            others.append(name)
        else:
            found.setdefault(f"{match['module']}.weight", {})[match["factor"]] = tensor
    unpaired = sorted(weight for weight, pair in found.items() if len(pair) != 2)
    if others or unpaired:
        raise ConversionError(
            f"{source}: {len(others)} tensors that are not LoRA factors ({listed(sorted(others))}), "
            f"{len(unpaired)} modules without both lora_A and lora_B ({listed(unpaired)})"
        )
    return {weight: Factors(pair["A"], pair["B"]) for weight, pair in found.items()}


def read_checkpoint_factors(ckpt: Path) -> dict[str, torch.Tensor]:
    """A LoRA actor's trainer checkpoint's factors by PEFT name, full size, as stored."""
    if not (ckpt / "metadata.json").is_file():
        raise ConversionError(f"{ckpt} is neither a megatron dist checkpoint (no metadata.json) nor a PEFT folder")
    reader = DcpReader(ckpt)
    shapes = {key: shape for key, (shape, _) in reader.entries.tensors.items() if _FACTOR.fullmatch(key)}
    if not shapes:
        raise ConversionError(
            f"{ckpt} holds no LoRA adapters (no base_model.model.<module>.lora_A.weight): "
            "a full-weight checkpoint converts with mcore-to-hf"
        )
    keys = sorted(shapes)
    tensors = reader.read([Slice(key, (0,) * len(shapes[key]), shapes[key]) for key in keys])
    return dict(zip(keys, tensors, strict=True))


def rank_of(factors: dict[str, Factors], source: Path) -> int:
    ranks = sorted({f.a.shape[0] for f in factors.values()})
    if len(ranks) != 1:
        raise ConversionError(f"{source}: adapters of ranks {ranks}; one rank for every module is supported")
    return ranks[0]


def run_lora(ckpt: Path) -> LoraConfig | None:
    """`actor.lora` of the run a trainer checkpoint belongs to (`<run>/config.yaml` above
    `<run>/checkpoints/global_step_N/actor/model`), or None where there is none."""
    parents = ckpt.resolve().parents
    if len(parents) < 4 or not (parents[3] / RUN_CONFIG).is_file():
        return None
    lora = OmegaConf.select(OmegaConf.load(parents[3] / RUN_CONFIG), "actor.lora")
    return None if lora is None else LoraConfig(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)


def checkpoint_lora(ckpt: Path, rank: int, alpha: float | None) -> LoraConfig:
    """The adapter's settings: `rank` (from the factors), alpha and dropout from the run's config.yaml; `alpha`
    overrides the run's and is needed without one."""
    run = run_lora(ckpt)
    if run is not None and run.rank != rank:
        raise ConversionError(
            f"{ckpt}: adapters of rank {rank}, but {RUN_CONFIG} three levels up has actor.lora.rank={run.rank}: "
            "it is another run's; copy the checkpoint out of that run directory and pass --alpha"
        )
    if run is None and alpha is None:
        raise ConversionError(
            f"{ckpt}: no {RUN_CONFIG} with actor.lora in the run directory above it: pass --alpha (actor.lora.alpha)"
        )
    known = run or LoraConfig(rank=rank)
    return LoraConfig(rank=rank, alpha=known.alpha if alpha is None else alpha, dropout=known.dropout)


def peft_scale(config: dict[str, Any], alpha: float | None, source: Path) -> float:
    """The update's scale for a PEFT adapter_config.json (`alpha` replacing its lora_alpha)."""
    unsupported = [key for key in ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out") if config.get(key)]
    if unsupported:
        raise ConversionError(f"{source}: {', '.join(unsupported)} set; only plain LoRA (one r, one alpha) merges")
    numerator = config["lora_alpha"] if alpha is None else alpha
    return numerator / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])


def load_adapter(source: str | Path, alpha: float | None = None) -> tuple[dict[str, Factors], float]:
    """A trainer checkpoint's or a PEFT adapter folder's factors by adapted weight, and the update's scale."""
    path = Path(source)
    if (path / CONFIG_FILE).is_file():
        config, tensors = read_peft(path)
        return by_weight(tensors, path), peft_scale(config, alpha, path)
    factors = by_weight(read_checkpoint_factors(path), path)
    return factors, checkpoint_lora(path, rank_of(factors, path), alpha).scale


def check_base(factors: dict[str, Factors], reader: SafetensorsReader, base: Path) -> None:
    """Raise unless every adapted weight is in the base, with the adapter's in and out sizes."""
    missing = sorted(weight for weight in factors if weight not in reader)
    if missing:
        raise ConversionError(
            f"{base} does not have {len(missing)} of the weights the adapter adapts ({listed(missing)}): "
            "the adapter was trained on another model"
        )
    mismatched = [
        f"{weight} {reader.shape(weight)} (adapter: {f.weight_shape})"
        for weight, f in factors.items()
        if reader.shape(weight) != f.weight_shape
    ]
    if mismatched:
        raise ConversionError(f"{base}: {len(mismatched)} shape mismatches with the adapter: {listed(mismatched)}")


def lora_to_peft(
    ckpt_dir: str | Path, out_dir: str | Path, base_dir: str | Path | None = None, alpha: float | None = None
) -> dict[str, Any]:
    """Write a LoRA actor's trainer checkpoint as a PEFT adapter folder (checked against `base_dir` when given);
    returns its adapter_config.json."""
    ckpt = Path(ckpt_dir)
    tensors = read_checkpoint_factors(ckpt)
    factors = by_weight(tensors, ckpt)
    if base_dir is not None:
        check_base(factors, SafetensorsReader(base_dir), Path(base_dir))
    cfg = checkpoint_lora(ckpt, rank_of(factors, ckpt), alpha)
    short_names = sorted({weight.removesuffix(".weight").rsplit(".", 1)[-1] for weight in factors})
    config = adapter_config(cfg, short_names, None if base_dir is None else str(Path(base_dir).resolve()))
    save_peft(out_dir, config, tensors)
    return config


def merged(weight: torch.Tensor, factors: Factors | None, scale: float) -> torch.Tensor:
    """W + scale·B·A, computed in fp32 and stored in W's dtype; W itself where nothing adapts it."""
    if factors is None:
        return weight
    return (weight.float() + scale * (factors.b.float() @ factors.a.float())).to(weight.dtype)


def merge_lora(
    source: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    alpha: float | None = None,
    max_shard_bytes: int = 2**30,
) -> ConversionStats:
    """Write `base_dir` with the adapter of `source` (a trainer checkpoint or a PEFT folder) merged in, tensor by
    tensor, with the base's config and tokenizer files."""
    base, out = Path(base_dir), Path(out_dir)
    rss = PeakRss()
    start = time.perf_counter()
    refuse_quantized(base)
    factors, scale = load_adapter(source, alpha)
    reader = SafetensorsReader(base)
    check_base(factors, reader, base)
    entries = [TensorEntry(name, reader.shape(name), reader.dtype(name)) for name in reader.names()]
    tmp = fresh_tmp(out)
    with SafetensorsShardWriter(tmp, entries, max_shard_bytes) as writer:
        for entry in entries:
            writer.write(entry.name, merged(reader.get(entry.name), factors.get(entry.name), scale))
            rss.sample()
    copy_model_files(base, tmp)
    replace_dir(tmp, out)
    return ConversionStats(len(entries), writer.total_bytes, time.perf_counter() - start, rss.growth)
