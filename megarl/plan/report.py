"""`build_plan(cfg)` → `Plan`: layouts, memory per device, the CP a full-length trajectory needs, batch algebra
with its padding share, LoRA's adapters against full fine-tuning (`megarl.plan.lora`), and weight-sync time;
`format_plan`.

Nothing is started: the model's shape comes from config.json, the rest from the config.
"""

from dataclasses import dataclass

from megarl.config.root import MegarlConfig
from megarl.config.sync import chosen_transport, delivery
from megarl.config.trainer import ASYNC_DRIVERS
from megarl.config.training import MegatronConfig
from megarl.engines.replicas.sglang_command import ReplicaLayout, replica_layout
from megarl.models.spec import ModelSpec, load_hf_config, model_spec
from megarl.plan import reward_models as frozen
from megarl.plan.adapters import adapter_stages, adapter_total
from megarl.plan.facts import (
    batch_sizes,
    critic_enabled,
    reference_needed,
    reward_pool_devices,
    rollout_devices,
    training_devices,
)
from megarl.plan.long_context import ContextNeed, context_need
from megarl.plan.lora import LoraBudget, lora_budget
from megarl.plan.memory import (
    GB,
    DevicePeaks,
    EngineMemory,
    RoleMemory,
    device_peaks,
    engine_dtype_bytes,
    engine_memory,
    micro_batch_tokens,
    role_memory,
)
from megarl.plan.overlap import StepEstimate, overlap_line, step_estimate
from megarl.plan.padding import LENGTHS, Padding, padding
from megarl.plan.params import ParamCounts, count_params, device_shard
from megarl.plan.vision import image_budget, image_lines


@dataclass(frozen=True, slots=True)
class Plan:
    cfg: MegarlConfig
    spec: ModelSpec
    counts: ParamCounts
    roles: dict[str, MegatronConfig]
    """The Megatron roles that will run, with their layouts."""
    memory: list[RoleMemory]
    engine: EngineMemory
    replicas: ReplicaLayout
    peaks: dict[str, DevicePeaks]
    sync_seconds: float
    step: StepEstimate
    """Rollout, training and sync time of one step (what asynchronous training overlaps)."""
    padding: dict[str, Padding]
    """Per training role: the share of computed tokens that is padding, padded and packed."""
    context: dict[str, ContextNeed]
    """Per training role: the CP its longest trajectory needs."""
    lora: LoraBudget | None
    """The actor's adapters against full fine-tuning (`actor.lora`); None without LoRA."""
    reward_models: dict[str, frozen.RewardModelSize]
    """The reward models and the teacher whose config.json is readable (`rm`, `judge`, `teacher`); on Megatron they are
    also in `memory`."""

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.peaks.values()) and self.engine.kv_tokens >= self.longest

    @property
    def longest(self) -> int:
        return self.cfg.data.max_prompt_length + self.cfg.data.max_response_length


def build_plan(cfg: MegarlConfig) -> Plan:
    """The plan of a validated config."""
    spec = model_spec(load_hf_config(cfg.model.path))
    counts = count_params(spec)
    roles = {"actor": cfg.actor.megatron}
    if reference_needed(cfg):  # with LoRA the reference is the actor itself, its adapters off
        roles["ref"] = cfg.actor.megatron if cfg.actor.lora.enabled else cfg.ref.megatron or cfg.actor.megatron
    if critic_enabled(cfg):
        roles["critic"] = cfg.critic.megatron
    devices = training_devices(cfg)
    rewards = frozen.reward_model_sizes(cfg)
    memory = [role_memory(name, cfg, spec, counts, mp, devices) for name, mp in roles.items()]
    memory += frozen.frozen_memory(cfg, rewards)
    engine = engine_memory(cfg, spec, counts)
    r = cfg.rollout
    sizes = (r.tensor_parallel_size, r.data_parallel_size, r.pipeline_parallel_size)
    tp, dp, pp = (1, 1, 1) if r.engine == "embedded" else sizes
    sync = sync_seconds(cfg, spec, counts)
    trained = [name for name in ("actor", "critic") if name in roles]
    return Plan(
        cfg=cfg,
        spec=spec,
        counts=counts,
        roles=roles,
        memory=memory,
        engine=engine,
        replicas=replica_layout(rollout_devices(cfg), cfg.trainer.devices_per_node, tp, dp, pp),
        peaks=device_peaks(cfg, memory, engine),
        sync_seconds=sync,
        step=step_estimate(cfg, counts, sync, replica_devices=tp * dp * pp),
        padding={name: padding(cfg, spec, name) for name in trained},
        context={name: context_need(cfg, spec, counts, memory, engine, name) for name in trained},
        lora=lora_budget(cfg, spec) if cfg.actor.lora.enabled else None,
        reward_models=rewards,
    )


def sync_seconds(cfg: MegarlConfig, spec: ModelSpec, counts: ParamCounts) -> float:
    """Estimated weight-sync time: gather the actor's shards into whole tensors, then deliver them.

    Gathering moves every byte a sender does not hold; it runs at `plan.intra_node_gbps` when one
    copy of the model fits in a node, else at `plan.inter_node_gbps`. Delivery: `tensor` hands
    CUDA IPC handles to colocated engines (a device-to-device copy, intra-node rate); `broadcast`
    sends the whole model to the separate rollout pool: between nodes (inter-node rate), or inside the
    node when the job has one (intra-node rate). With LoRA and `actor.lora.sync=adapter` only the adapters
    move, full size (`_synced_params`).
    """
    mp, plan = cfg.actor.megatron, cfg.plan
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    experts = mp.expert_model_parallel_size * (mp.expert_tensor_parallel_size or tp)
    span = max(tp * pp * mp.context_parallel_size, experts * pp)
    gather_rate = plan.intra_node_gbps if span <= cfg.trainer.devices_per_node else plan.inter_node_gbps
    broadcast = chosen_transport(cfg.sync, cfg.trainer.placement) == "broadcast"
    deliver_rate = plan.inter_node_gbps if broadcast and cfg.trainer.nnodes > 1 else plan.intra_node_gbps
    moved, delivered = _synced_params(cfg, spec, counts)
    return engine_dtype_bytes(cfg) * (moved / gather_rate + delivered / deliver_rate) / GB


def _synced_params(cfg: MegarlConfig, spec: ModelSpec, counts: ParamCounts) -> tuple[float, int]:
    """Per update: the parameters a sender gathers from other ranks (all but its own share, averaged over the
    pipeline stages), and those delivered to the engines (the model, or with `actor.lora.sync=adapter` the
    adapters)."""
    mp, lora = cfg.actor.megatron, cfg.actor.lora
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    if lora.enabled and lora.sync == "adapter":
        adapters = adapter_total(spec, lora)
        return adapters - sum(stage.total for stage in adapter_stages(spec, lora, mp)) / pp, adapters
    experts = mp.expert_model_parallel_size * (mp.expert_tensor_parallel_size or tp)
    expert_params = counts.routed_experts
    dense_params = counts.total - expert_params
    return dense_params * (1 - 1 / (tp * pp)) + expert_params * (1 - 1 / (experts * pp)), counts.total


def format_plan(plan: Plan) -> str:
    """The plan as the text `megarl-plan` prints."""
    sections = _model(plan) + _layouts(plan) + _memory(plan) + _long_context(plan) + _batches(plan) + _lora(plan)
    return "\n".join(sections + _sync(plan) + _verdict(plan))


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _gb(n: float) -> str:
    return f"{n / GB:6.1f} GB" if n >= 0.1 * GB or n == 0 else f"{n / 1e6:6.1f} MB"


def _seconds(s: float) -> str:
    """Tenths of a second, or of a millisecond below 0.1 s (an adapter's sync)."""
    return f"{s:.1f} s" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def _model(plan: Plan) -> list[str]:
    s, c = plan.spec, plan.counts
    attention = f"{s.num_heads} heads / {s.num_kv_heads} KV heads"
    if s.mla is not None:
        attention = f"{s.num_heads} heads, MLA (KV latent {s.mla.kv_lora_rank} + RoPE key {s.mla.qk_rope_head_dim})"
    dense = s.num_layers - s.num_moe_layers if s.is_moe else 0
    shared = f" + shared {s.shared_expert_ffn_hidden_size} wide" if s.shared_expert_ffn_hidden_size else ""
    moe = f", {s.num_experts} experts top-{s.moe_topk}{shared}" if s.is_moe else ""
    trained = "frozen" if plan.cfg.model.freeze_vision_tower else "trained"
    vision = f", of which the vision tower {_b(c.vision)} ({trained}, first stage)" if c.vision else ""
    return [
        f"model      {plan.cfg.model.path}",
        f"           {s.model_type}: {s.num_layers} layers{f' ({dense} dense)' if dense else ''}, "
        f"hidden {s.hidden_size}, {attention}{moe}",
        f"           parameters: {_b(c.total)} total, {_b(c.active)} active per token{vision}",
    ] + (image_lines(plan.cfg, image_budget(plan.cfg)) if c.vision else [])


def _span(first: int, count: int, devices_per_node: int) -> str:
    """Devices [first, first + count) as "node a device b .. node c device d" (pools fill nodes in order)."""
    last = first + count - 1
    return (
        f"node {first // devices_per_node} device {first % devices_per_node} .. "
        f"node {last // devices_per_node} device {last % devices_per_node}"
    )


def _pools(plan: Plan) -> list[str]:
    """The Ray resource pools: one shared pool, or the train pool then the rollout pool; then the reward pools."""
    cfg, dpn = plan.cfg, plan.cfg.trainer.devices_per_node
    train, rollout = training_devices(cfg), rollout_devices(cfg)
    roles = ", ".join(m.name for m in plan.memory)
    replicas = f"{plan.replicas.num_replicas} {cfg.rollout.engine} replica(s)"
    if cfg.trainer.placement == "colocated":
        rollout, lines = 0, [f"pools      shared: {train} device(s), {_span(0, train, dpn)}: {roles} and {replicas}"]
    else:
        lines = [
            f"pools      train: {train} device(s), {_span(0, train, dpn)}: {roles}",
            f"           rollout: {rollout} device(s), {_span(train, rollout, dpn)}: {replicas} "
            "(trainer.rollout_devices)",
        ]
    first = train + rollout
    for name, devices in reward_pool_devices(cfg).items():
        lines.append(
            f"           {name}: {devices} device(s), {_span(first, devices, dpn)}: {frozen.pool_text(cfg, name)}"
        )
        first += devices
    return lines


def _layouts(plan: Plan) -> list[str]:
    t, devices = plan.cfg.trainer, training_devices(plan.cfg)
    dpn = t.devices_per_node
    lines = ["", f"devices    {t.nnodes} node(s) × {dpn} {t.device} devices, placement={t.placement}", *_pools(plan)]
    for name, mp in plan.roles.items():
        if name == "ref" and plan.lora is not None:
            lines.append(f"{name:<10} the actor with its adapters off (actor.lora): no weights of its own")
            continue
        tp, pp, cp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.context_parallel_size
        line = f"{name:<10} TP={tp} PP={pp} CP={cp} DP={devices // (tp * pp * cp)}"
        if plan.spec.is_moe:
            etp, ep = mp.expert_tensor_parallel_size or tp, mp.expert_model_parallel_size
            where = "inside a node" if ep * etp <= dpn else "across nodes"
            line += f"; experts EP={ep} ETP={etp} EDP={devices // (ep * etp * pp)} (all-to-all {where})"
        if tp * cp > dpn:
            line += f"; TP×CP={tp * cp} crosses nodes (slow)"
        lines.append(line)
    rl = plan.replicas
    lines.append(
        f"rollout    {rl.num_replicas} replica(s) of {rl.devices_per_replica} device(s) "
        f"(TP={rl.tp} DP={rl.dp} PP={rl.pp}), {rl.nodes_per_replica} node(s) each"
    )
    first = 0 if t.placement == "colocated" else devices
    for i in range(min(rl.num_replicas, 4)):
        size = rl.devices_per_replica
        lines.append(f"           replica {i}: {_span(first + i * size, size, dpn)}")
    if rl.num_replicas > 4:
        lines.append(f"           ... {rl.num_replicas - 4} more")
    return lines + frozen.model_lines(plan.cfg, plan.reward_models)


def _memory(plan: Plan) -> list[str]:
    lines = ["", "memory per device (GB = 1e9 bytes; the fullest pipeline stage)"]
    lines.append(f"{'':10} {'params':>9} {'grads':>9} {'optimizer':>9} {'activations':>11} {'offloaded':>9}")
    for m in plan.memory:
        lines.append(
            f"{m.name:<10} {_gb(m.params)} {_gb(m.grads)} {_gb(m.optimizer)}    {_gb(m.activations)} "
            f"{_gb(m.offloaded)}   ({_held(plan, m.name)})"
        )
    e = plan.engine
    if plan.cfg.rollout.engine == "embedded":
        source = "embedded engine: the KV cache of all its trajectories at once"
    else:
        source = f"rollout.mem_fraction_static={plan.cfg.rollout.mem_fraction_static}"
    lines.append(f"engine     weights {_gb(e.weights)}, static {_gb(e.static)} ({source}), KV pool {_gb(e.kv_pool)}")
    per_replica = e.kv_tokens * plan.replicas.dp  # TP and PP ranks each hold a slice of the same tokens
    lines.append(
        f"KV cache   {e.kv_bytes_per_token / 1e3:.1f} kB/token/device → {e.kv_tokens} tokens per device, "
        f"{per_replica // plan.longest} full-length trajectories ({plan.longest} tokens) per replica at once"
    )
    for kind, p in plan.peaks.items():
        verdict = "fits" if p.fits else "DOES NOT FIT"
        lines.append(
            f"peak       {kind} devices: training {_gb(p.training)}, rollout {_gb(p.rollout)} of "
            f"{_gb(p.limit)} (incl. {plan.cfg.plan.reserved_gb} GB reserved) → {verdict}"
        )
    return lines


def _held(plan: Plan, role: str) -> str:
    """The parameters a role's fullest device holds; with LoRA, the actor's frozen ones and its adapters."""
    if role in ("rm", "teacher"):
        return frozen.frozen_held(plan.reward_models, role)
    shard = device_shard(plan.counts, plan.roles[role], value_head=role == "critic")
    held = f"{_b(shard.total)} params: {_b(shard.dense)} dense, {_b(shard.expert)} expert"
    if plan.lora is None or role == "critic":
        return held
    if role == "ref":
        return "the actor with its adapters off"
    return f"{held}, frozen; {_b(plan.lora.trainable_params_per_device)} adapter params"


def _lora(plan: Plan) -> list[str]:
    """What the actor's adapters train, keep and send, against training every weight (`megarl.plan.lora`)."""
    if plan.lora is None:
        return []
    b, lora = plan.lora, plan.cfg.actor.lora
    adapter, merged = _gb(b.adapter_sync_bytes).strip(), _gb(b.full_sync_bytes).strip()
    sync = f"{adapter} per update (the adapters) vs {merged} merged"
    if lora.sync == "merged":
        sync = f"{merged} per update (merged) vs {adapter} with actor.lora.sync=adapter"
    optimizer = [_gb(n).strip() for n in (b.optimizer_bytes, b.full_optimizer_bytes)]
    per_device = [_gb(n).strip() for n in (b.optimizer_bytes_per_device, b.full_optimizer_bytes_per_device)]
    return [
        "",
        f"lora       actor.lora: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}, "
        f"sync={lora.sync}; base weights frozen, no reference model (the actor with its adapters off)",
        f"           trainable {_b(b.trainable_params)} of {_b(b.full_params)} params "
        f"({b.trainable_params / b.full_params:.2%}), {_b(b.trainable_params_per_device)} of "
        f"{_b(b.full_params_per_device)} per device; optimizer state {optimizer[0]} vs {optimizer[1]} training every "
        f"weight ({per_device[0]} vs {per_device[1]} per device)",
        f"           sync {sync} ({b.adapter_sync_bytes / b.full_sync_bytes:.2%})",
    ]


def _batches(plan: Plan) -> list[str]:
    cfg = plan.cfg
    samples = cfg.data.train_batch_size * cfg.rollout.n
    lines = [
        "",
        f"batches    {cfg.data.train_batch_size} prompts × n={cfg.rollout.n} = {samples} trajectories per step; "
        f"{samples / plan.replicas.num_replicas:.0f} per rollout replica",
    ]
    for role in [r for r in ("actor", "critic") if r in plan.roles]:
        s = batch_sizes(cfg, role)
        micro = "token-budget micro-batches" if s.micro_batches is None else f"{s.micro_batches} micro-batch(es)"
        lines.append(
            f"{role:<10} {s.mini_batches_per_step} mini-batch(es) of {s.trajectories_per_mini_batch} trajectories "
            f"over DP={s.dp}: {s.trajectories_per_device or '~'} per device per mini-batch, {micro} of "
            f"≤{micro_batch_tokens(cfg, role)} tokens"
        )
        lines.append(_padding_line(plan, role))
    return lines + ([f"           (padding with {LENGTHS}: megarl-plan reads no data)"] if plan.padding else [])


def _padding_line(plan: Plan, role: str) -> str:
    p, mp = plan.padding[role], plan.roles[role]
    peers = f" (each micro-batch as long as the longest of {p.peers} expert-parallel peers')" if p.peers > 1 else ""
    runs = "packed" if mp.sequence_packing else f"padded ({role}.megatron.sequence_packing=false)"
    return f"           padding: {p.padded:.1%} of computed tokens padded, {p.packed:.1%} packed{peers}; runs {runs}"


def _long_context(plan: Plan) -> list[str]:
    """Per training role: the CP one longest trajectory needs (`megarl.plan.long_context`)."""
    lines: list[str] = []
    for role, need in plan.context.items():
        where = f"on {plan.cfg.plan.device_memory_gb:g} GB devices"
        verdict = f"needs CP≥{need.cp} {where}" if need.cp else f"fits at no CP ≤ {need.at} {where}"
        verdict = f"fits without CP {where}" if need.cp == 1 else verdict
        label = "long ctx" if not lines else ""
        lines.append(
            f"{label:<10} {role}: a {need.tokens}-token trajectory alone in a micro-batch {verdict} "
            f"(CP={need.at}: activations {_gb(need.activations).strip()}, training peak {_gb(need.peak).strip()})"
            + "".join(f"; {b}" for b in _cp_blockers(plan, role, need))
        )
    return ["", *lines] if lines else []


def _cp_blockers(plan: Plan, role: str, need: ContextNeed) -> list[str]:
    """What keeps megarl from running the CP `need` asks for."""
    if need.cp == 1:
        return []
    return [] if plan.roles[role].sequence_packing else [f"CP needs {role}.megatron.sequence_packing=true"]


def _sync(plan: Plan) -> list[str]:
    cfg, t = plan.cfg, plan.cfg.trainer
    transport = chosen_transport(cfg.sync, t.placement)
    return [
        "",
        f"sync       ~{_seconds(plan.sync_seconds)} per update ({transport}; intra-node "
        f"{cfg.plan.intra_node_gbps} GB/s, inter-node {cfg.plan.inter_node_gbps} GB/s)",
        f"           {delivery(cfg.sync, t.placement, t.device, t.nnodes, training_devices(cfg))}",
    ] + ([overlap_line(cfg, plan.step)] if t.driver in ASYNC_DRIVERS else [])


def _verdict(plan: Plan) -> list[str]:
    if plan.fits:
        return ["", "verdict    fits"]
    hints = []
    if plan.engine.kv_tokens < plan.longest:
        hints.append("the engine's KV pool holds less than one trajectory: raise rollout.mem_fraction_static or TP")
    hints += _context_hints(plan)
    if any(not p.fits for p in plan.peaks.values()):
        hints.append(
            "too much per device: raise TP/PP/EP, set ref.offload=true / critic.offload=true, lower "
            "ppo_micro_batch_size_per_device (or ppo_max_token_len_per_device) or rollout.mem_fraction_static, "
            "or add nodes"
        )
    return ["", "verdict    DOES NOT FIT: " + "; ".join(hints)]


def _context_hints(plan: Plan) -> list[str]:
    """The roles whose CP is below what one full-length trajectory needs."""
    hints = []
    for role, need in plan.context.items():
        if need.cp is None:
            hints.append(f"no {role}.megatron.context_parallel_size fits one full-length trajectory: add devices")
        elif need.cp > plan.roles[role].context_parallel_size:
            hints.append(f"one full-length trajectory needs {role}.megatron.context_parallel_size ≥ {need.cp}")
    return hints
