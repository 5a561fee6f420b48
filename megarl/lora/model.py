"""LoRA on a role's built model: adapters on the targeted linear layers, the base frozen, the reference pass with
the adapters off.

`apply_lora` freezes every base parameter (megatron's DDP then gives them no gradient buffer and its optimizer no
state: distributed/distributed_data_parallel.py and optimizer/__init__.py skip `requires_grad=False`) and hangs
each chunk's adapters under `chunk.lora` (`LoraLayers`), hooked onto their layers' outputs. Checkpoints name each
factor by its PEFT name (`base_model.model.<hf module>.lora_A.weight`), full-size with its TP split, so they
load at any layout.
"""

import dataclasses
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt import GPTModel

from megarl.config.lora import LoraConfig
from megarl.lora.layer import LoraAdapter, Sharding, gaussian_a, kaiming_a
from megarl.lora.targets import LoraPart, LoraTarget, lora_targets
from megarl.megatron.model import ADAPTERS, BuiltModel
from megarl.megatron.parallel import RoleGroups
from megarl.megatron.weights import global_name


def peft_name(part: LoraPart, factor: str) -> str:
    """The name PEFT's `save_pretrained` gives a factor (`A` or `B`) in adapter_model.safetensors."""
    return f"base_model.model.{part.hf_module}.lora_{factor}.weight"


class LoraLayers(torch.nn.Module):
    """One chunk's adapters."""

    def __init__(self, adapters: list[LoraAdapter], modules: list[str]) -> None:
        super().__init__()
        self.adapters = torch.nn.ModuleList(adapters)
        self.by_module: dict[str, LoraAdapter] = dict(zip(modules, adapters, strict=True))
        """Chunk-local module name (`decoder.layers.0.self_attention.linear_qkv`) → its adapter."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, ShardedTensor]:
        """Each factor under its PEFT name at full size, split on its TP dimension (megatron's `sharded_state_dict`
        protocol, called by the GPTModel that holds this module)."""
        out = {}
        for i, adapter in enumerate(self.by_module.values()):
            for j, part in enumerate(adapter.target.parts):
                for factor, params, split_dim in (("A", adapter.a, 1), ("B", adapter.b, 0)):
                    key = f"{prefix}adapters.{i}.{factor.lower()}.{j}"
                    out[key] = _sharded(peft_name(part, factor), params[j], adapter, split_dim)
        return out


def _sharded(key: str, param: torch.Tensor, adapter: LoraAdapter, dim: int) -> ShardedTensor:
    """A factor's ShardedTensor: split over TP on `dim` where its layer splits it (B rows of a column layer, A
    columns of a row layer), else replicated over TP (only TP rank 0's copy is the main replica); DP rank 0's copy
    is saved."""
    s = adapter.sharding
    if s.tp_size > 1 and adapter.target.tp_dim == dim:
        return ShardedTensor.from_rank_offsets(key, param, (dim, s.tp_rank, s.tp_size), replica_id=(0, s.dp_rank))
    return ShardedTensor.from_rank_offsets(key, param, replica_id=(s.tp_rank, s.dp_rank))


def _seeded_init(cfg: LoraConfig, seed: int) -> Any:
    draw = kaiming_a if cfg.init == "kaiming" else gaussian_a

    def init(part: LoraPart) -> torch.Tensor:
        digest = hashlib.sha256(f"{seed}/lora/{part.hf_module}".encode()).digest()
        return draw(part, cfg.rank, torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")))

    return init


def _sharding(target: LoraTarget, groups: RoleGroups, sequence_parallel: bool) -> Sharding:
    if target.expert:
        if groups.layout.etp > 1:
            raise ValueError("LoRA on MoE experts needs expert_tensor_parallel_size=1")
        return Sharding(1, 0, None, False, groups.pgs.expt_dp.rank())
    tp = groups.layout.tp
    return Sharding(tp, groups.tp_rank, groups.pgs.tp, sequence_parallel and tp > 1, groups.pgs.dp_cp.rank())


def _add_adapter(adapter: LoraAdapter, module: torch.nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook: the layer's (output, bias) with the adapter's term added to the output. A TransformerEngine
    layer that fuses its input norm (`layer_norm_weight`) gets the normalised input, as its GEMM does."""
    if not adapter.enabled:
        return output
    x = args[0]
    norm = getattr(module, "layer_norm_weight", None)
    if norm is not None:
        eps = float(getattr(module, "config").layernorm_epsilon)  # noqa: B009 (a TE layer's TransformerConfig)
        x = torch.nn.functional.rms_norm(x, norm.shape, norm, eps)
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _chunk_adapters(
    chunk: GPTModel, model: BuiltModel, groups: RoleGroups, targets: dict[str, LoraTarget], cfg: LoraConfig, seed: int
) -> LoraLayers:
    adapters, modules = [], []
    device = next(chunk.parameters()).device
    for name, module in chunk.named_modules():
        target = targets.get(
            global_name(f"{name}.weight", chunk, groups, model.spec.num_experts).removesuffix(".weight")
        )
        if target is None:
            continue
        sharding = _sharding(target, groups, model.config.sequence_parallel)
        adapter = LoraAdapter(
            target,
            cfg.rank,
            cfg.scale,
            cfg.dropout,
            sharding,
            _seeded_init(cfg, seed),
            model.config.params_dtype,
            device,
        )
        module.register_forward_hook(partial(_add_adapter, adapter))
        adapters.append(adapter)
        modules.append(name)
    return LoraLayers(adapters, modules)


def apply_lora(model: BuiltModel, groups: RoleGroups, cfg: LoraConfig, seed: int) -> BuiltModel:
    """Freeze the base and add adapters (A seeded per (seed, HF module), the same under every layout; B zero).
    Call before `make_trainable`. Returns the model with `adapters` set."""
    targets = {t.mcore_module: t for t in lora_targets(model.spec, cfg.target_modules, te=model.options.use_te)}
    layers = []
    for chunk in model.chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        chunk_layers = _chunk_adapters(chunk, model, groups, targets, cfg, seed)
        chunk.add_module(ADAPTERS, chunk_layers)
        layers.append(chunk_layers)
    return dataclasses.replace(model, adapters=tuple(layers))


def adapters_of(model: BuiltModel) -> Iterator[LoraAdapter]:
    for layers in model.adapters:
        assert isinstance(layers, LoraLayers)
        yield from layers.by_module.values()


def adapter_of(chunk: torch.nn.Module, param_name: str) -> LoraAdapter | None:
    """The adapter on the layer whose weight is the chunk's parameter `param_name` (None: no adapter there)."""
    layers = getattr(chunk, ADAPTERS, None)
    if not isinstance(layers, LoraLayers) or not param_name.endswith(".weight"):
        return None
    return layers.by_module.get(param_name.removesuffix(".weight"))


@contextmanager
def adapters_disabled(model: BuiltModel) -> Iterator[None]:
    """The base model: every adapter off meanwhile (the reference policy of a LoRA actor)."""
    adapters = list(adapters_of(model))
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True
