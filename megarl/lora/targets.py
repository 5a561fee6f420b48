"""Which megatron-core linear layers get adapters, and the HF (PEFT) projections each one's adapters stand for.

Read off the weight plan (`megarl.models.weight_map`), so the adapters follow the same fusing and tensor-parallel
split as the weights: a fused layer (`linear_qkv`, `linear_fc1`) gets one adapter per HF projection it fuses
that `target_modules` names, a column-parallel layer (`tp_dim` 0) splits B like its output rows, a row-parallel one
(`tp_dim` 1) splits A like its input columns, a replicated one (`tp_dim` None, MLA's down projections) splits
neither. Routers, norms, embeddings and the LM head get none.

Usage::

    for target in lora_targets(spec, ["all-linear"], padded_vocab_size=256):
        target.mcore_module  # "decoder.layers.0.self_attention.linear_qkv"
        [p.hf_module for p in target.parts]  # ["model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"]
"""

from dataclasses import dataclass

from megarl.config.lora import ALL_LINEAR
from megarl.models.param_mapping import ParamMapping
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import weight_plan

LINEAR_LAYERS = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
"""Megatron linear layers that may carry adapters (the weight plan names their `.weight`)."""


@dataclass(frozen=True, slots=True)
class LoraPart:
    """One HF projection inside a megatron layer: A `[r, in_features]`, B `[out_features, r]` at full size."""

    hf_module: str
    """e.g. `model.layers.0.self_attn.q_proj` (PEFT names its tensors `base_model.model.<hf_module>.lora_A.weight`)."""
    short_name: str
    """The `target_modules` name it answers to (`q_proj`, `w1`, …)."""
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class LoraTarget:
    mcore_module: str
    """Global megatron module name (HF layer and expert numbering), without `.weight`."""
    parts: tuple[LoraPart, ...]
    """The targeted projections, in the fused layer's order."""
    mapping: ParamMapping
    """The layer weight's mapping: how the parts fuse (`fuse`, `qkv_groups`) and split (`tp_dim`, `tp_group`)."""
    present: tuple[bool, ...]
    """Per HF tensor of `mapping.hf_names`: whether it is targeted (an untargeted part of a fused layer adds 0)."""

    @property
    def tp_dim(self) -> int | None:
        return self.mapping.tp_dim

    @property
    def expert(self) -> bool:
        return self.mapping.tp_group == "etp"


def _short_name(hf_tensor: str) -> str:
    return hf_tensor.removesuffix(".weight").rsplit(".", 1)[-1]


def _is_linear(mapping: ParamMapping) -> bool:
    module = mapping.mcore_name.removesuffix(".weight")
    return mapping.mcore_name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR_LAYERS


def wanted(short_name: str, target_modules: list[str] | tuple[str, ...]) -> bool:
    return ALL_LINEAR in target_modules or short_name in target_modules


def lora_targets(spec: ModelSpec, target_modules: list[str] | tuple[str, ...], te: bool = False) -> list[LoraTarget]:
    """Every adapted layer of the full model, in the weight plan's (model) order."""
    out = []
    for mapping in weight_plan(spec, padded_vocab_size=spec.vocab_size, te=te).values():
        if not _is_linear(mapping):
            continue
        present = tuple(wanted(_short_name(name), target_modules) for name in mapping.hf_names)
        if not any(present):
            continue
        parts = tuple(
            LoraPart(name.removesuffix(".weight"), _short_name(name), shape[1], shape[0])
            for name, shape, on in zip(mapping.hf_names, mapping.hf_shapes, present, strict=True)
            if on
        )
        out.append(LoraTarget(mapping.mcore_name.removesuffix(".weight"), parts, mapping, present))
    return out


def adapter_param_count(targets: list[LoraTarget], rank: int) -> int:
    """Trainable parameters of the adapters (full size, every rank's share together)."""
    return sum(rank * (part.in_features + part.out_features) for target in targets for part in target.parts)


def targeted_short_names(spec: ModelSpec, target_modules: list[str] | tuple[str, ...]) -> set[str]:
    """The `target_modules` names the model has layers for (an empty set: nothing would be adapted)."""
    return {part.short_name for target in lora_targets(spec, target_modules) for part in target.parts}
