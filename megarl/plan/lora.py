"""LoRA on the actor (`actor.lora`) in the plan and the gate.

`lora_budget(cfg)` → `LoraBudget`: what the actor trains, the optimizer state it keeps and the bytes a weight sync
sends, each beside what full fine-tuning of the same layout would. `lora_model_problems(cfg, spec)`: the gate's
LoRA checks that need the model (which layers `actor.lora.target_modules` adapts; `megarl.lora.targets`).
"""

from dataclasses import dataclass

from megarl.config.lora import ALL_LINEAR
from megarl.config.root import MegarlConfig
from megarl.lora.targets import targeted_short_names
from megarl.models.spec import ModelSpec, load_hf_config, model_spec
from megarl.plan.adapters import adapter_shard, adapter_total, model_targets
from megarl.plan.facts import training_devices
from megarl.plan.memory import engine_dtype_bytes, optimizer_bytes, optimizer_state_bytes
from megarl.plan.params import count_params, device_shard


@dataclass(frozen=True, slots=True)
class LoraBudget:
    """The actor's trainable parameters, optimizer state and sync bytes with LoRA, and with full fine-tuning."""

    trainable_params: int
    """Adapter parameters of the whole model, full size (`megarl.lora.targets.adapter_param_count`)."""
    trainable_params_per_device: int
    """Adapter parameters on the actor's fullest device (`megarl.plan.adapters.adapter_shard`)."""
    full_params: int
    """What full fine-tuning trains: every parameter of the model."""
    full_params_per_device: int
    """Parameters on the actor's fullest device (`megarl.plan.params.device_shard`)."""
    optimizer_bytes: float
    """Optimizer state of the adapters, one copy of each (Adam's m and v, fp32 master copies of 16-bit ones)."""
    full_optimizer_bytes: float
    """The same for every parameter."""
    optimizer_bytes_per_device: float
    """The adapters' optimizer state on the actor's fullest device (the distributed optimizer splits it over DP)."""
    full_optimizer_bytes_per_device: float
    """The same with full fine-tuning."""
    adapter_sync_bytes: float
    """What one weight sync delivers with `actor.lora.sync=adapter`: every adapter, full size, in the engine dtype."""
    full_sync_bytes: float
    """What one weight sync delivers with `actor.lora.sync=merged` (or without LoRA): the whole model."""


def lora_budget(cfg: MegarlConfig, spec: ModelSpec | None = None) -> LoraBudget:
    """The budget of `cfg.actor.lora` on the model at `cfg.model.path` (its `spec` when the caller has it)."""
    spec = model_spec(load_hf_config(cfg.model.path)) if spec is None else spec
    counts, lora, mp = count_params(spec), cfg.actor.lora, cfg.actor.megatron
    devices, optim, dtype_bytes = training_devices(cfg), cfg.actor.optim.name, engine_dtype_bytes(cfg)
    adapters, shard = adapter_shard(spec, lora, mp), device_shard(counts, mp)
    trainable, state = adapter_total(spec, lora), optimizer_state_bytes(cfg, optim)
    return LoraBudget(
        trainable_params=trainable,
        trainable_params_per_device=adapters.total,
        full_params=counts.total,
        full_params_per_device=shard.total,
        optimizer_bytes=state * trainable,
        full_optimizer_bytes=state * counts.total,
        optimizer_bytes_per_device=optimizer_bytes(cfg, optim, adapters, mp, devices),
        full_optimizer_bytes_per_device=optimizer_bytes(cfg, optim, shard, mp, devices),
        adapter_sync_bytes=trainable * dtype_bytes,
        full_sync_bytes=counts.total * dtype_bytes,
    )


def lora_model_problems(cfg: MegarlConfig, spec: ModelSpec) -> list[str]:
    """What `actor.lora.target_modules` adapts on this model, against the actor's layout and the rollout engine."""
    lora, mp = cfg.actor.lora, cfg.actor.megatron
    modules = list(lora.target_modules)
    if spec.vision is not None:  # the adapters' HF names and the vision tower's linears are not mapped yet
        return [
            f"actor.lora.rank={lora.rank}: LoRA is not supported for vision-language models ({spec.vision.family}) "
            "yet; set actor.lora.rank=0 to train every weight"
        ]
    targets = model_targets(spec, tuple(modules))
    if not targets:
        names = ", ".join(sorted(targeted_short_names(spec, [ALL_LINEAR])))
        return [
            f"actor.lora.target_modules={modules} matches no layer of {spec.model_type}; it has {names} "
            f"(or {ALL_LINEAR}): choose from those"
        ]
    experts = ", ".join(sorted({part.short_name for t in targets if t.expert for part in t.parts}))
    if not experts:
        return []
    leave_out = f"or leave the experts' {experts} out of actor.lora.target_modules (e.g. [q_proj,k_proj,v_proj,o_proj])"
    problems = []
    etp = mp.expert_tensor_parallel_size or mp.tensor_model_parallel_size
    if etp > 1:
        field = f"actor.megatron.expert_tensor_parallel_size={mp.expert_tensor_parallel_size}"
        if mp.expert_tensor_parallel_size is None:
            field += f" (follows actor.megatron.tensor_model_parallel_size={mp.tensor_model_parallel_size})"
        problems.append(
            f"actor.lora.target_modules={modules} adapts the experts' {experts}, whose adapters need expert-TP 1, "
            f"but {field}: set actor.megatron.expert_tensor_parallel_size=1, {leave_out}"
        )
    if lora.sync == "adapter" and cfg.rollout.engine == "embedded":
        problems.append(
            f"actor.lora.sync=adapter with rollout.engine=embedded: the embedded engine applies adapters through peft, "
            f"which cannot adapt transformers' fused expert tensors ({experts} of the experts); "
            f"set actor.lora.sync=merged, {leave_out}"
        )
    return problems
