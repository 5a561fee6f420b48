"""Adapters ⇄ PEFT: full-size tensors under PEFT's names, the adapter_config.json dict, and adapter folders.

A PEFT adapter folder is what `peft.PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads:
`adapter_config.json` (a `LoraConfig`) and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
`[r, in]`, `lora_B.weight` `[out, r]`, peft/utils/save_and_load.py `get_peft_model_state_dict`). SGLang's
`/load_lora_adapter_from_tensors` takes the same dict and tensors.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.lora import LoraConfig
from megarl.lora.layer import LoraAdapter
from megarl.lora.model import adapters_of, peft_name
from megarl.megatron.model import BuiltModel
from megarl.megatron.parallel import RoleGroups

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(cfg: LoraConfig, short_names: list[str], base_model: str | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json for adapters on the HF projections `short_names`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(short_names),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
    }


def short_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The HF projection names (`q_proj`, …) that PEFT tensors adapt: a config's `target_modules`."""
    return sorted({name.removesuffix(".weight").split(".")[-2] for name in tensors})


def _owner(adapter: LoraAdapter, groups: RoleGroups) -> bool:
    if adapter.target.expert:
        return groups.pgs.expt_dp.rank() == 0
    return groups.tp_rank == 0 and groups.pgs.dp_cp.rank() == 0


def _full(param: torch.Tensor, adapter: LoraAdapter, dim: int) -> torch.Tensor:
    """A factor at full size: its TP shards gathered where its layer splits it (collective over TP)."""
    s = adapter.sharding
    if s.tp_size == 1 or adapter.target.tp_dim != dim:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(s.tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=s.group)
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def local_adapter_tensors(
    model: BuiltModel, groups: RoleGroups, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The adapters this rank owns (TP rank 0 and DP rank 0 of its stage, expert-DP rank 0 for experts), full
    size on CPU in `dtype` (default: as trained). Collective over each adapter's TP group."""
    out = {}
    for adapter in adapters_of(model):
        owner = _owner(adapter, groups)
        for part, a, b in zip(adapter.target.parts, adapter.a, adapter.b, strict=True):
            full_a, full_b = _full(a, adapter, 1), _full(b, adapter, 0)
            if owner:
                out[peft_name(part, "A")] = full_a.to("cpu", dtype or a.dtype)
                out[peft_name(part, "B")] = full_b.to("cpu", dtype or b.dtype)
    return out


def gather_adapter(model: BuiltModel, groups: RoleGroups, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every adapter tensor on the role's rank 0 (others: {}). Collective over the role's ranks."""
    mine = local_adapter_tensors(model, groups, dtype)
    everyone: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    )
    dist.gather_object(mine, everyone, dst=0)
    return {name: t for part in everyone or [] for name, t in part.items()}


@torch.no_grad()
def load_adapter_tensors(model: BuiltModel, tensors: Mapping[str, torch.Tensor], source: str) -> int:
    """Copy full-size PEFT tensors into this rank's adapter shards; returns the factors filled. `source` names
    where they came from, for errors."""
    filled = 0
    for adapter in adapters_of(model):
        for part, a, b in zip(adapter.target.parts, adapter.a, adapter.b, strict=True):
            for factor, param, dim in (("A", a, 1), ("B", b, 0)):
                _copy_factor(param, adapter, dim, tensors, peft_name(part, factor), source)
                filled += 1
    return filled


def _copy_factor(
    param: torch.Tensor, adapter: LoraAdapter, dim: int, tensors: Mapping[str, torch.Tensor], name: str, source: str
) -> None:
    if name not in tensors:
        raise KeyError(f"{source} has no {name}: the adapter's target_modules differ from actor.lora's")
    shard = adapter.shard(tensors[name], dim)
    if shard.shape != param.shape:
        raise ValueError(
            f"{source}: {name} has shape {tuple(tensors[name].shape)}; actor.lora.rank and the model give this "
            f"rank's shard the shape {tuple(param.shape)}"
        )
    param.copy_(shard)


def save_peft(out_dir: str | Path, config: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write a PEFT adapter folder, atomically (a temporary sibling renamed into place)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE))
    old = tmp.with_name(tmp.name + ".old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_peft(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT adapter folder's config and tensors, with a clear error for a folder that is not one."""
    from safetensors.torch import load_file

    root = Path(adapter_dir)
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{root} is not a PEFT adapter folder: no {', '.join(missing)}")
    config = json.loads((root / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{root / CONFIG_FILE}: peft_type {config['peft_type']!r}; megarl imports LORA adapters")
    return config, load_file(str(root / WEIGHTS_FILE))
