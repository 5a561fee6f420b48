"""Where each megatron parameter lives in a dist checkpoint (torch_dist format).

megatron-core stores a layer's parameter once for all layers: key `decoder.layers.<name>` with
a leading layer axis, experts with a layer and an expert axis (`decoder.layers.mlp.experts.experts.<name>`).
When dense and MoE layers mix (`megarl.megatron.bridge.moe_layer_freq` is a list), each layer has keys of
its own (`decoder.layers.<i>.<name>`, experts with an expert axis only). The norms sit under the
keys of TransformerEngine's layers whichever layer spec built the model
(`megarl.megatron.bridge.layer_spec`), so one checkpoint loads with either `transformer_impl`. The
global tensor behind a key is the full (TP=1) mcore tensor, so a checkpoint is independent of
the TP/PP/EP it was written at. `DistSlot` says where one global parameter of the weight plan
sits; a test checks these rules against megatron's own `sharded_state_dict`.

Usage::

    slot = dist_slot("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight", spec)
    slot.key, slot.prefix, slot.prefix_sizes
    # ('decoder.layers.mlp.experts.experts.linear_fc2.weight', (3, 5), (num_layers, num_experts))
"""

import re
from dataclasses import dataclass

import torch

from megarl.models import mla
from megarl.models.param_mapping import ParamMapping
from megarl.models.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_NORM_KEYS = {  # TE fuses these norms into the next linear; a MoE layer's pre-MLP norm stays a TENorm
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True, slots=True)
class DistSlot:
    key: str
    """Key in the dist checkpoint."""
    prefix: tuple[int, ...]
    """Offsets on the leading axes: () | (layer,) | (layer, expert); with mixed layers () | (expert,)."""
    prefix_sizes: tuple[int, ...]
    """Sizes of the leading axes: () | (num_layers,) | (num_layers, num_experts); mixed: () | (num_experts,)."""
    layer: int | None = None
    """The decoder layer (None for the embedding, final norm and output layer)."""

    def global_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*self.prefix_sizes, *full_shape)

    def offsets(self, ndim: int) -> tuple[int, ...]:
        """Offsets of this parameter's chunk inside the global tensor."""
        return (*self.prefix, *([0] * ndim))

    def sizes(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Sizes of this parameter's chunk: 1 on the leading axes, then the full tensor."""
        return (*([1] * len(self.prefix)), *full_shape)


def dist_slot(global_name: str, spec: ModelSpec) -> DistSlot:
    """The dist-checkpoint key and leading-axis offsets of a global mcore parameter name."""
    layer = _LAYER.match(global_name)
    if layer is None:
        return DistSlot(global_name, (), ())
    index, rest = int(layer.group(1)), layer.group(2)
    stacked = all(spec.moe_layers)  # megatron stacks the layers unless dense and MoE layers mix
    key = "decoder.layers." if stacked else f"decoder.layers.{index}."
    prefix: tuple[int, ...] = (index,) if stacked else ()
    sizes: tuple[int, ...] = (spec.num_layers,) if stacked else ()
    expert = _EXPERT.match(rest)
    if expert is not None:
        e = int(expert.group(1))
        key = f"{key}mlp.experts.experts.{expert.group(2)}"
        return DistSlot(key, (*prefix, e), (*sizes, spec.num_experts), index)
    if not (spec.is_moe and spec.moe_layers[index] and rest == "pre_mlp_layernorm.weight"):
        rest = (mla.DIST_NORM_KEYS if spec.mla else _NORM_KEYS).get(rest, rest)
    return DistSlot(f"{key}{rest}", prefix, sizes, index)


def full_shape(mapping: ParamMapping) -> tuple[int, ...]:
    """Shape of the full (TP=1) mcore tensor, from the HF shapes the config implies."""
    meta = [torch.empty(shape, device="meta") for shape in mapping.hf_shapes]
    return tuple(mapping.merge(meta).shape)
