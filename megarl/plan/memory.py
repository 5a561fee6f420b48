"""Estimated bytes per device: Megatron roles (state + activations), the rollout engine, and the fit.

Model of the memory (the same one megarl's Megatron setup uses):
- parameters in `model.dtype`; gradients in fp32 (megarl reduces gradients in fp32);
- Adam keeps m and v in fp32, plus an fp32 master copy when parameters are 16-bit; with the
  distributed optimizer that state is split over the data-parallel group (experts: over the
  expert-data-parallel group);
- activations of one micro-batch per layer kept for backward (no recomputation; flash attention,
  so no s×s scores; each layer as it is: dense or MoE, GQA or MLA, with shared experts), times the
  micro-batches in flight (1F1B: up to PP on the first stage), plus the output layer's logits and
  one fp32 log-prob chunk; the micro-batch is the fullest one the trainer can form (`micro_batch_tokens`),
  packed or padded, and context parallelism gives each rank 1/CP of its tokens;
- SGLang takes `rollout.mem_fraction_static` of the device for weights + KV cache (the embedded
  engine: its weights plus the KV cache of all its trajectories at once); the cache holds K and V
  per KV head, or under multi-latent attention one compressed latent per token and layer;
- colocated, the actor moves its parameters, gradients and optimizer state to host while the
  engine generates (`megarl.sync.sequence`); the reference and critic do with `ref.offload` and
  `critic.offload`;
- LoRA on the actor (`actor.lora`): gradients and optimizer state of the adapters alone
  (`megarl.plan.adapters`), the base weights frozen in `model.dtype`, no reference model of its own;
  activations as without LoRA (the adapters' rank-wide intermediates are left out);
- a vision-language model's tower on the first stage: activations when trained (`megarl.plan.vision`).
"""

from dataclasses import dataclass

from megarl.config.layout import stage_layers
from megarl.config.root import MegarlConfig
from megarl.config.training import MegatronConfig
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import padded_vocab_size
from megarl.plan.adapters import adapter_shard
from megarl.plan.facts import rollout_devices
from megarl.plan.params import DeviceShard, ParamCounts, device_shard
from megarl.plan.vision import tower_activation_bytes

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4
LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per fp32 log-softmax chunk (`megarl.megatron.engine` default)."""


@dataclass(frozen=True, slots=True)
class RoleMemory:
    """Bytes on the fullest device of one Megatron role."""

    name: str
    params: float
    grads: float
    optimizer: float
    activations: float
    offloaded: float
    """Part of params + grads + optimizer moved to host while the colocated engine generates."""

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """Bytes on one device of a rollout replica."""

    weights: float
    static: float
    """mem_fraction_static × device memory: weights + KV cache."""
    kv_bytes_per_token: float

    @property
    def kv_pool(self) -> float:
        return self.static - self.weights

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool of one device holds (0 when the weights leave no room)."""
        return max(0, int(self.kv_pool // self.kv_bytes_per_token))


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """Peak bytes on a device in each phase, against the usable memory."""

    training: float
    """Megatron roles training (the colocated engine asleep)."""
    rollout: float
    """The engine generating (colocated roles keep what they do not offload)."""
    limit: float

    @property
    def fits(self) -> bool:
        return max(self.training, self.rollout) <= self.limit


def token_multiple(mp: MegatronConfig) -> int:
    """What every row (packed) or the width (padded) of a micro-batch is rounded up to: TP under sequence
    parallelism, × 2·CP under context parallelism (`megarl.megatron.inputs.InputBuilder`)."""
    cp = mp.context_parallel_size
    return (mp.tensor_model_parallel_size if mp.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def round_up(tokens: int, multiple: int) -> int:
    """`tokens` rounded up to a multiple of `multiple`."""
    return -(-tokens // multiple) * multiple


def micro_batch_tokens(cfg: MegarlConfig, role: str) -> int:
    """Tokens the fullest training micro-batch of `role` computes, summed over its CP ranks.

    Packed (`sequence_packing`), a micro-batch computes its rows' real tokens, each rounded up to
    `token_multiple`; padded, rows × its longest row (rounded up). The budget (`use_dynamic_bsz`) counts exactly
    that, so either way the fullest micro-batch fills it, and a trajectory longer than the budget runs alone;
    a fixed count of rows is fullest when every row is full length. The peak is therefore the same packed or
    padded: packing removes padding from the typical micro-batch (`megarl.plan.padding`), not from the worst.
    """
    rc = cfg.actor if role == "actor" else cfg.critic
    multiple = token_multiple(rc.megatron)
    longest = round_up(cfg.data.max_prompt_length + cfg.data.max_response_length, multiple)
    if rc.use_dynamic_bsz:
        return max(rc.ppo_max_token_len_per_device // multiple * multiple, longest)
    return rc.ppo_micro_batch_size_per_device * longest


def activation_bytes(
    spec: ModelSpec,
    mp: MegatronConfig,
    tokens: int,
    in_flight: int,
    act_bytes: int,
    logits: bool,
    first_stage: float = 0.0,
) -> float:
    """Activations kept for backward on one device: micro-batches of `tokens` tokens through one pipeline stage's
    layers, `in_flight` on the first stage and at most PP - i on stage i (1F1B), on the stage where that is most
    (with uneven stages or dense first layers not always the first). `first_stage`: bytes per micro-batch that only
    the first stage keeps (a vision tower's, `megarl.plan.vision`)."""
    tp, pp, cp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.context_parallel_size
    t = tokens / cp
    moe_layers = spec.moe_layers or (False,) * spec.num_layers
    stages = stage_layers(mp, spec.num_layers)
    per_token = [sum(_layer_activations(spec, mp, moe_layers[i]) for i in layers) for layers in stages]
    kept = [
        (t * act_bytes * n + (first_stage if stage == 0 else 0.0)) * min(in_flight, pp - stage)
        for stage, n in enumerate(per_token)
    ]
    body = max(kept)
    if not logits:
        return body
    vocab = padded_vocab_size(spec.vocab_size, tp) / tp
    return body + vocab * (t * act_bytes + min(t, LOGPROB_CHUNK_TOKENS) * 4 * 3)


def _layer_activations(spec: ModelSpec, mp: MegatronConfig, moe: bool) -> float:
    """Values per token that one layer keeps for backward on one device."""
    tp = mp.tensor_model_parallel_size
    etp = mp.expert_tensor_parallel_size or tp
    sp = tp if mp.sequence_parallel else 1
    h = spec.hidden_size
    per_token = 4 * h / sp + _attention_activations(spec, tp)  # residuals + norm outputs; attention
    if not moe:
        return per_token + 3 * spec.ffn_hidden_size / tp  # SwiGLU intermediates
    # router logits; each routed copy keeps its input, output and SwiGLU intermediates; so does the shared expert
    routed = spec.moe_topk * etp / sp
    per_token += spec.num_experts / sp + routed * (2 * h + 3 * spec.moe_ffn_hidden_size / etp)
    return per_token + 3 * spec.shared_expert_ffn_hidden_size / tp


def _attention_activations(spec: ModelSpec, tp: int) -> float:
    """Q, K, V and the attention output per token (flash attention: no s×s scores). Multi-latent attention
    adds its down projections' outputs before and after their norms, whole on every TP rank."""
    if spec.mla is None:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return (2 * q + 2 * kv) / tp
    mla = spec.mla
    latents = 2 * (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    return latents + spec.num_heads * (2 * mla.qk_head_dim + 2 * mla.v_head_dim) / tp


def role_memory(
    name: str,
    cfg: MegarlConfig,
    spec: ModelSpec,
    counts: ParamCounts,
    mp: MegatronConfig,
    num_devices: int,
    tokens: int | None = None,
) -> RoleMemory:
    """Memory of `name` (actor | critic | ref) on its fullest device, with micro-batches of `tokens` tokens
    (default: the fullest the config allows, `micro_batch_tokens`).

    With LoRA (`actor.lora.rank` > 0) the actor trains its adapters alone: the base weights stay in `model.dtype`
    with no gradient buffer and no optimizer state (megatron allocates both only for parameters that require
    grad), and the reference is the actor with its adapters off, so it takes nothing of its own."""
    lora = cfg.actor.lora.enabled
    if name == "ref" and lora:
        return RoleMemory(name, 0.0, 0.0, 0.0, 0.0, 0.0)
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    shard = device_shard(counts, mp, value_head=name == "critic")
    colocated = cfg.trainer.placement == "colocated"
    if name == "ref":
        params = shard.total * param_bytes
        return RoleMemory(name, params, 0.0, 0.0, 0.0, params if colocated and cfg.ref.offload else 0.0)
    adapters = lora and name == "actor"
    trainable = adapter_shard(spec, cfg.actor.lora, mp) if adapters else _without_frozen_tower(cfg, counts, mp, shard)
    frozen = shard.total if adapters else shard.total - trainable.total  # LoRA's base, a frozen tower: weights only
    params = (frozen + trainable.total) * param_bytes
    rc = cfg.actor if name == "actor" else cfg.critic
    optimizer = optimizer_bytes(cfg, rc.optim.name, trainable, mp, num_devices)
    grads = trainable.total * GRAD_BYTES
    tokens = micro_batch_tokens(cfg, name) if tokens is None else tokens
    in_flight = min(mp.pipeline_model_parallel_size, _micro_batches(cfg, name, num_devices, mp, tokens))
    tower = tower_activation_bytes(cfg, spec, tokens, param_bytes)
    activations = activation_bytes(spec, mp, tokens, in_flight, param_bytes, name == "actor", tower)
    offloads = name == "actor" or cfg.critic.offload  # the colocated actor always does (megarl.sync.sequence)
    offloaded = params + grads + optimizer if colocated and offloads else 0.0
    return RoleMemory(name, params, grads, optimizer, activations, offloaded)


def _without_frozen_tower(
    cfg: MegarlConfig, counts: ParamCounts, mp: MegatronConfig, shard: DeviceShard
) -> DeviceShard:
    """`shard` less a frozen vision tower (no gradient, no optimizer state), when the fullest stage is the tower's
    (without PP); under PP, or with the projector trained, the tower is counted as trained (an over-estimate)."""
    frozen = cfg.model.freeze_vision_tower and not cfg.model.train_projector and mp.pipeline_model_parallel_size == 1
    return DeviceShard(dense=shard.dense - counts.vision, expert=shard.expert) if frozen else shard


def optimizer_state_bytes(cfg: MegarlConfig, optim: str) -> int:
    """Optimizer bytes per trainable parameter: Adam's m and v in fp32, plus an fp32 master copy of a 16-bit one."""
    return (8 if optim == "adam" else 0) + (4 if DTYPE_BYTES[cfg.model.dtype] < 4 else 0)


def optimizer_bytes(cfg: MegarlConfig, optim: str, trainable: DeviceShard, mp: MegatronConfig, devices: int) -> float:
    """Optimizer state of a device's `trainable` parameters (`optimizer_state_bytes` each); the distributed optimizer
    splits that of dense ones over DP, of expert ones over expert-DP."""
    state = optimizer_state_bytes(cfg, optim)
    if not mp.use_distributed_optimizer:
        return state * trainable.total
    tp, pp, cp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.context_parallel_size
    etp, ep = mp.expert_tensor_parallel_size or tp, mp.expert_model_parallel_size
    dp, expert_dp = devices // (tp * pp * cp), devices // (ep * etp * pp)
    return state * (trainable.dense / dp + trainable.expert / expert_dp)


def _micro_batches(cfg: MegarlConfig, role: str, num_devices: int, mp: MegatronConfig, tokens: int) -> int:
    """Micro-batches per device per mini-batch, every trajectory full length, `tokens` tokens each."""
    rc = cfg.actor if role == "actor" else cfg.critic
    dp = num_devices // (mp.tensor_model_parallel_size * mp.pipeline_model_parallel_size * mp.context_parallel_size)
    per_device = rc.ppo_mini_batch_size * cfg.rollout.n // max(dp, 1)
    longest = round_up(cfg.data.max_prompt_length + cfg.data.max_response_length, token_multiple(mp))
    return max(1, per_device * longest // tokens)


def engine_memory(cfg: MegarlConfig, spec: ModelSpec, counts: ParamCounts) -> EngineMemory:
    """Weights and KV cache on one device of a replica (`kv_values_per_token` per layer of its pipeline stage).

    SGLang reserves `mem_fraction_static` of the device; the embedded engine grows its cache per request.
    """
    r = cfg.rollout
    tp, pp = (1, 1) if r.engine == "embedded" else (r.tensor_parallel_size, r.pipeline_parallel_size)
    dtype_bytes = engine_dtype_bytes(cfg)
    weights = counts.total * dtype_bytes / (tp * pp)
    kv_per_token = (spec.num_layers // pp) * kv_values_per_token(spec, tp) * dtype_bytes
    static = r.mem_fraction_static * cfg.plan.device_memory_gb * GB
    if r.engine == "embedded":  # no preallocated pool: the weights plus the KV of all its trajectories at once
        trajectories = -(-cfg.data.train_batch_size * r.n // rollout_devices(cfg))
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        static = weights + trajectories * longest * kv_per_token
    return EngineMemory(weights=weights, static=static, kv_bytes_per_token=kv_per_token)


def engine_dtype_bytes(cfg: MegarlConfig) -> int:
    """Bytes per value of the engines' weights, KV cache and weight updates (`rollout.dtype`; auto = `model.dtype`)."""
    return DTYPE_BYTES[cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype]


def kv_values_per_token(spec: ModelSpec, tp: int) -> int:
    """KV-cache values one layer of the engine stores per token on each of `tp` ranks.

    Grouped-query attention: K and V of the rank's KV heads (TP splits them, replicating below one per
    rank). Multi-latent attention: the compressed latent and the shared RoPE key, kv_lora_rank +
    qk_rope_head_dim values, whole on every rank: SGLang's `MLATokenToKVPool`
    (sglang/srt/mem_cache/memory_pool.py) keeps one [tokens, 1, kv_lora_rank + qk_rope_head_dim] buffer
    per layer, whatever the TP size.
    """
    if spec.mla is not None:
        return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    return 2 * -(-spec.num_kv_heads // tp) * spec.head_dim


def device_peaks(cfg: MegarlConfig, roles: list[RoleMemory], engine: EngineMemory) -> dict[str, DevicePeaks]:
    """Peaks per kind of device: `shared` when colocated, else `training` and `rollout` devices."""
    reserved, limit = cfg.plan.reserved_gb * GB, cfg.plan.device_memory_gb * GB
    state = sum(r.state for r in roles)
    training = reserved + state + max((r.activations for r in roles), default=0.0)
    if cfg.trainer.placement == "separate":
        return {
            "training": DevicePeaks(training, 0.0, limit),
            "rollout": DevicePeaks(0.0, reserved + engine.static, limit),
        }
    asleep = 0.0 if cfg.rollout.enable_memory_saver else engine.static
    resident = state - sum(r.offloaded for r in roles)
    return {"shared": DevicePeaks(training + asleep, reserved + engine.static + resident, limit)}
