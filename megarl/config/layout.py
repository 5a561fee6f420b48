"""What a parallel layout must respect in the model: facts read from config.json and the checks.

`read_model_facts` reads only config.json (no transformers import), so `megarl-plan` and
`validate` can check layouts of models whose weights are not on this machine.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from megarl.config.training import MegatronConfig

TRAINING_DEVICES = (
    "trainer.nnodes × trainer.devices_per_node, less trainer.rollout_devices when placement=separate and less the "
    "reward models' engine pools (reward_model.*.engines.devices)"
)
"""Where the training device count of the layout messages comes from."""


class ConfigError(ValueError):
    """The config cannot run; the message lists every problem with its field and fix."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What layout checks need from the HF config.json."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    max_position_embeddings: int
    ffn_hidden_size: int = 0
    """Dense MLP width (intermediate_size)."""
    moe_ffn_hidden_size: int = 0
    """Width of one expert (moe_intermediate_size); 0 for a dense model."""
    vision: bool = False
    """A vision-language model (config.json has a `vision_config`)."""
    deepstack_layers: int = 0
    """Decoder layers 0 .. n-1 take Qwen3-VL deepstack features: they must be in the first pipeline chunk."""


def read_model_facts(model_path: str) -> ModelFacts:
    """Read layer/head/expert counts from `<model_path>/config.json`."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path: {config_file} does not exist; point model.path at a HF model directory")
    top = json.loads(config_file.read_text())
    hf = {**top, **top.get("text_config", {})}  # a vision-language model's language model
    num_heads = int(hf["num_attention_heads"])
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)
    ffn = int(hf.get("intermediate_size") or 0)
    return ModelFacts(
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        num_experts=num_experts,
        max_position_embeddings=int(hf.get("max_position_embeddings", 0)),
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=int(hf.get("moe_intermediate_size") or ffn) if num_experts else 0,
        vision="vision_config" in top,
        deepstack_layers=len(top.get("vision_config", {}).get("deepstack_visual_indexes") or ()),
    )


def _first_chunk_layers(mp: MegatronConfig, num_layers: int, stages: int) -> int:
    """Decoder layers on the first virtual chunk of the first pipeline stage."""
    first = mp.num_layers_in_first_pipeline_stage
    return first // (mp.virtual_pipeline_model_parallel_size or 1) if first is not None else num_layers // stages


def check_layout(prefix: str, mp: MegatronConfig, facts: ModelFacts, num_devices: int) -> list[str]:
    """Problems of one Megatron role's layout (`prefix` names its config, e.g. actor.megatron)."""
    tp, pp, cp, ep = (
        mp.tensor_model_parallel_size,
        mp.pipeline_model_parallel_size,
        mp.context_parallel_size,
        mp.expert_model_parallel_size,
    )
    etp = mp.expert_tensor_parallel_size or tp
    stages = pp * (mp.virtual_pipeline_model_parallel_size or 1)
    if min(tp, pp, cp, ep, etp) < 1:
        return [f"{prefix}: parallel sizes must be >= 1 (got tp={tp} pp={pp} cp={cp} ep={ep} etp={etp})"]
    problems = []
    if cp > 1 and not mp.sequence_packing:
        problems.append(
            f"{prefix}.context_parallel_size={cp} splits packed sequences over CP ranks: set "
            f"{prefix}.sequence_packing=true (or context_parallel_size=1)"
        )
    if facts.deepstack_layers > _first_chunk_layers(mp, facts.num_layers, stages):
        problems.append(
            f"{prefix}: the vision tower's deepstack features are added after decoder layers 0.."
            f"{facts.deepstack_layers - 1}, which must all be on the first pipeline stage's first chunk: set "
            f"{prefix}.num_layers_in_first_pipeline_stage >= {facts.deepstack_layers} (or fewer pipeline stages)"
        )
    if facts.num_heads % tp or facts.num_kv_heads % tp:
        problems.append(
            f"{prefix}.tensor_model_parallel_size={tp} must divide the model's {facts.num_heads} attention heads "
            f"and {facts.num_kv_heads} KV heads"
        )
    if facts.num_experts == 0 and facts.ffn_hidden_size % tp:
        problems.append(
            f"{prefix}.tensor_model_parallel_size={tp} must divide the MLP width {facts.ffn_hidden_size} "
            "(intermediate_size)"
        )
    if mp.num_layers_in_first_pipeline_stage is not None or mp.num_layers_in_last_pipeline_stage is not None:
        problems += _check_uneven_stages(prefix, mp, facts.num_layers)
    elif facts.num_layers % stages:
        problems.append(
            f"{prefix}.pipeline_model_parallel_size={pp} × virtual stages "
            f"{mp.virtual_pipeline_model_parallel_size or 1} must divide the model's {facts.num_layers} layers; "
            f"or set {prefix}.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
        )
    problems += _check_experts(prefix, mp, facts, tp)
    if num_devices % (tp * pp * cp):
        problems.append(
            f"{prefix}: tp×pp×cp = {tp}×{pp}×{cp} must divide the {num_devices} training devices ({TRAINING_DEVICES})"
        )
    elif num_devices % (etp * ep * pp):
        problems.append(
            f"{prefix}: expert_tensor_parallel×expert_model_parallel×pp = {etp}×{ep}×{pp} must divide the "
            f"{num_devices} training devices ({TRAINING_DEVICES})"
        )
    return problems


def _check_experts(prefix: str, mp: MegatronConfig, facts: ModelFacts, tp: int) -> list[str]:
    ep, etp = mp.expert_model_parallel_size, mp.expert_tensor_parallel_size or tp
    if facts.num_experts == 0:
        if ep > 1:
            return [f"{prefix}.expert_model_parallel_size={ep} needs a MoE model; set it to 1 for a dense model"]
        return []
    problems = []
    if facts.num_experts % ep:
        divisors = [d for d in range(1, facts.num_experts + 1) if facts.num_experts % d == 0]
        problems.append(
            f"{prefix}.expert_model_parallel_size={ep} must divide the model's {facts.num_experts} experts; "
            f"choose one of {divisors}"
        )
    if facts.moe_ffn_hidden_size % etp:
        field = "expert_tensor_parallel_size" if mp.expert_tensor_parallel_size else "tensor_model_parallel_size"
        problems.append(
            f"{prefix}.{field}={etp} splits each expert and must divide its width {facts.moe_ffn_hidden_size} "
            f"(moe_intermediate_size); set {prefix}.expert_tensor_parallel_size=1 to keep experts whole"
        )
    if tp > 1 and not mp.sequence_parallel:
        problems.append(f"{prefix}.sequence_parallel must be true for a MoE model with tensor_model_parallel_size>1")
    return problems


def _check_uneven_stages(prefix: str, mp: MegatronConfig, num_layers: int) -> list[str]:
    """Problems of uneven pipeline stages, as megatron's TransformerConfig.__post_init__ ("Uneven PP") and
    transformer_block.py `get_num_layers_to_build` would raise them."""
    pp, vpp = mp.pipeline_model_parallel_size, mp.virtual_pipeline_model_parallel_size or 1
    fields = "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
    if pp == 1:
        return [
            f"{prefix}.{fields} split layers over pipeline stages: set them to null with pipeline_model_parallel_size=1"
        ]
    set_counts = {
        name: n
        for name, n in (
            ("num_layers_in_first_pipeline_stage", mp.num_layers_in_first_pipeline_stage),
            ("num_layers_in_last_pipeline_stage", mp.num_layers_in_last_pipeline_stage),
        )
        if n is not None
    }
    problems = [
        f"{prefix}.{name}={n} must be >= 1 and a multiple of virtual stages {vpp}"
        for name, n in set_counts.items()
        if n < 1 or n % vpp
    ]
    middle, middle_stages = num_layers - sum(set_counts.values()), pp - len(set_counts)
    if middle < middle_stages or (middle_stages == 0 and middle) or (middle_stages and middle % (middle_stages * vpp)):
        problems.append(
            f"{prefix}.{fields}: the other {middle_stages} stage(s) get the model's {num_layers} layers less "
            f"{sum(set_counts.values())} = {middle}, which must be split evenly, at least one layer per stage "
            f"(× virtual stages {vpp}); change the first/last counts so that they are"
        )
    return problems


def stage_layer_counts(mp: MegatronConfig, num_layers: int) -> list[int]:
    """Layers of each pipeline stage as megatron splits them (transformer_block.py `get_num_layers_to_build`): the
    first and last stage as set, the others `num_layers` less those, evenly."""
    pp, first, last = (
        mp.pipeline_model_parallel_size,
        mp.num_layers_in_first_pipeline_stage,
        mp.num_layers_in_last_pipeline_stage,
    )
    uneven = [n for n in (first, last) if n is not None]
    middle_stages = pp - len(uneven)
    counts = [(num_layers - sum(uneven)) // middle_stages if middle_stages else 0] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(mp: MegatronConfig, num_layers: int) -> list[list[int]]:
    """The (0-based, HF) layer indices each pipeline stage holds. With virtual stages each stage holds one chunk per
    round, the chunks of a round in stage order (transformer_layer.py `get_transformer_layer_offset`)."""
    vpp = mp.virtual_pipeline_model_parallel_size or 1
    stages: list[list[int]] = [[] for _ in range(mp.pipeline_model_parallel_size)]
    start = 0
    for _ in range(vpp):
        for held, count in zip(stages, stage_layer_counts(mp, num_layers), strict=True):
            held.extend(range(start, start + count // vpp))
            start += count // vpp
    return stages
