"""LoRA adapter parameters (`actor.lora`) by where they live in a Megatron layout: the trainable part of a LoRA
actor, as `megarl.plan.params` counts the weights.

The adapted layers and their shapes are `megarl.lora.targets.lora_targets`': every targeted HF projection gets
A `[r, in_features]` and B `[out_features, r]`. Under tensor parallelism a column-parallel layer (`tp_dim` 0)
keeps A whole on every rank and splits B, a row-parallel one (`tp_dim` 1) splits A and keeps B whole, a replicated
one (`tp_dim` None, MLA's down projections) keeps both whole. An expert's adapters live on its expert-parallel rank
and split over expert-TP the same way. A pipeline stage holds its layers' adapters.
"""

from functools import lru_cache

from megarl.config.layout import stage_layers
from megarl.config.lora import LoraConfig
from megarl.config.training import MegatronConfig
from megarl.lora.targets import LoraPart, LoraTarget, adapter_param_count, lora_targets
from megarl.models.spec import ModelSpec
from megarl.plan.params import DeviceShard


@lru_cache(maxsize=8)
def model_targets(spec: ModelSpec, target_modules: tuple[str, ...]) -> tuple[LoraTarget, ...]:
    """`lora_targets` of the full model, cached: the gate and the plan ask for them several times, and a large MoE
    model has tens of thousands (one per expert projection)."""
    return tuple(lora_targets(spec, target_modules))


def adapter_stages(spec: ModelSpec, lora: LoraConfig, mp: MegatronConfig) -> list[DeviceShard]:
    """Per pipeline stage: the adapter parameters one device holds, dense ones (optimizer state over DP) and expert
    ones (over expert-DP), on the expert-parallel rank with its share of the experts."""
    pp, ep = mp.pipeline_model_parallel_size, mp.expert_model_parallel_size
    stage_of = {layer: stage for stage, held in enumerate(stage_layers(mp, spec.num_layers)) for layer in held}
    dense, expert = [0] * pp, [0] * pp
    for target in model_targets(spec, tuple(lora.target_modules)):
        stage = stage_of[int(target.mcore_module.split(".")[2])]  # decoder.layers.<i>.…
        held = sum(_held(target, part, lora.rank, mp) for part in target.parts)
        if target.expert:
            expert[stage] += held
        else:
            dense[stage] += held
    return [DeviceShard(dense=d, expert=e // ep) for d, e in zip(dense, expert, strict=True)]


def adapter_shard(spec: ModelSpec, lora: LoraConfig, mp: MegatronConfig) -> DeviceShard:
    """The adapters on the fullest device: the pipeline stage with the most of them (with dense first layers, as in
    DeepSeek-V3, not always the stage `device_shard` picks for the weights, so their sum bounds the device above)."""
    return max(adapter_stages(spec, lora, mp), key=lambda shard: shard.total)


def adapter_total(spec: ModelSpec, lora: LoraConfig) -> int:
    """Adapter parameters of the whole model, full size (`adapter_param_count`)."""
    return adapter_param_count(list(model_targets(spec, tuple(lora.target_modules))), lora.rank)


def _held(target: LoraTarget, part: LoraPart, rank: int, mp: MegatronConfig) -> int:
    """Adapter parameters of one HF projection on a device that holds its layer."""
    tp = mp.tensor_model_parallel_size
    split = (mp.expert_tensor_parallel_size or tp) if target.expert else tp
    a_split = split if target.tp_dim == 1 else 1  # row-parallel: A [r, in/split]
    b_split = split if target.tp_dim == 0 else 1  # column-parallel: B [out/split, r]
    return rank * (part.in_features // a_split + part.out_features // b_split)
