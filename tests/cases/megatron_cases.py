"""Tiny HF models, batches and per-rank functions shared by the multi-process Megatron tests and bench."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from megarl.config.model import ModelConfig
from megarl.config.training import MegatronConfig
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.model import build_model
from megarl.megatron.optim import Trainable
from megarl.megatron.parallel import ParallelLayout, RoleGroups, build_role_groups
from megarl.megatron.weights import SafetensorsReader, load_hf_weights
from megarl.models.spec import load_hf_config, model_spec

ASSET_MODELS = Path(__file__).resolve().parents[2] / "megarl" / "assets" / "models"
ARCH_CONFIGS = {
    "qwen2": {"model_type": "qwen2", "rope_theta": 1e6},
    "llama": {
        "model_type": "llama",
        "rope_theta": 5e5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "head_dim": 16,
    },
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6},
    "qwen2_moe": {  # a gated shared expert; dense layers 0 and 2 (every second layer routes)
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 2,
        "rope_theta": 1e6,
    },
    "glm4_moe": {  # sigmoid routing with a correction bias and scaling, q/k/v biases, half-rotary heads
        "model_type": "glm4_moe",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "head_dim": 16,
        "num_nextn_predict_layers": 0,
    },
    "deepseek_v3": {  # MLA (q and kv low-rank), YaRN, interleaved rope; group-limited top-k, dense layer 0
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,  # MLA: as many as query heads
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
    },
    "moonlight": {  # DeepSeek-V3 as Moonlight ships it: a full q_proj, plain rope, rms_norm_eps 1e-5
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_theta": 5e4,
        "rms_norm_eps": 1e-5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446,
        "num_nextn_predict_layers": 0,
    },
}


def save_random_model(
    arch: str,
    path: Path,
    vocab_size: int = 250,
    num_layers: int = 2,
    seed: int = 0,
    tie: bool = False,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    **overrides: Any,
) -> Path:
    """A tiny (unless sized up) random HF model of `arch` (see `_save_randomized`); `overrides` of its config."""
    extra = {**ARCH_CONFIGS[arch], **overrides}
    model_type = extra.pop("model_type")
    base = {"num_key_value_heads": 2}  # an `ARCH_CONFIGS` entry may override it
    config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        hidden_act="silu",
        **{**base, **extra},
    )
    return _save_randomized(config, path, seed)


def save_asset_model(name: str, path: Path, seed: int = 0) -> Path:
    """One of megarl's shipped tiny configs (`megarl/assets/models/tiny_*`) with random weights, saved as HF."""
    config = transformers.AutoConfig.from_pretrained(ASSET_MODELS / name)
    return _save_randomized(config, path, seed)


def _auto_class(config: transformers.PretrainedConfig) -> Any:
    """transformers' auto class of `config`'s model: image-text-to-text for a vision-language one."""
    vision = hasattr(config, "vision_config")
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def _save_randomized(config: transformers.PretrainedConfig, path: Path, seed: int) -> Path:
    """Save a model with O(1) logits (linears N(0, 1/fan_in), norms 1±0.2, biases ±0.2, the routers'
    `e_score_correction_bias` buffers too); a vision-language config as its image-text-to-text model."""
    torch.manual_seed(seed)
    model = _auto_class(config).from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * (2 * torch.rand_like(param) - 1))
            elif name.endswith("bias"):
                param.copy_(0.2 * (2 * torch.rand_like(param) - 1))
            else:
                fan_in = param[0].numel() if param.dim() > 3 else param.shape[-1]  # a patch conv: its whole kernel
                param.normal_(0, fan_in**-0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * (2 * torch.rand_like(buffer) - 1))
    model.save_pretrained(path)
    return path


def sample_batch(
    vocab_size: int, num_rows: int = 6, prompt_len: int = 7, response_len: int = 9, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of varied lengths (one row without a response)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (num_rows, prompt_len + response_len), generator=g)
    prompt_lens = torch.randint(2, prompt_len + 1, (num_rows,), generator=g)
    response_lens = torch.randint(1, response_len + 1, (num_rows,), generator=g)
    response_lens[-1] = 0
    cols = torch.arange(prompt_len + response_len)
    prompt_mask = (cols < prompt_len) & (cols >= prompt_len - prompt_lens.unsqueeze(1))
    response_mask = (cols >= prompt_len) & (cols < prompt_len + response_lens.unsqueeze(1))
    attention_mask = (prompt_mask | response_mask).long()
    input_ids = input_ids * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, prompt_len:],
        "response_mask": attention_mask[:, prompt_len:],
    }


@torch.no_grad()
def hf_token_stats(model_dir: Path, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' log-probs, entropy and Σ_v π(v)² of the response tokens `[b, r]` (0 off the mask)."""
    model = (
        _auto_class(transformers.AutoConfig.from_pretrained(model_dir))
        .from_pretrained(model_dir, attn_implementation="eager")
        .float()
    )
    mask = batch["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    r = batch["responses"].shape[1]
    log_softmax = logits[:, -r - 1 : -1].log_softmax(-1)
    stats = {
        "log_probs": log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
        "sum_pi_squared": log_softmax.exp().square().sum(-1),
    }
    return {key: value * batch["response_mask"] for key, value in stats.items()}


def hf_log_probs(model_dir: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return hf_token_stats(model_dir, batch)["log_probs"]


def rank_calls(calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """On every rank: each (function, arguments) of `calls` in turn, sharing one spawn's start-up; the results."""
    return [fn(*args) for fn, args in calls]


def layout(world_size: int, **sizes: int) -> ParallelLayout:
    """`sizes` with expert-TP = TP; sequence parallel when asked for or with EP and TP (MoE under TP needs it)."""
    base = ParallelLayout(world_size=world_size, **sizes)
    sequence_parallel = base.sequence_parallel or (base.tp > 1 and "ep" in sizes)
    return replace(base, sequence_parallel=sequence_parallel, etp=base.tp)


def rank_log_probs(
    cases: list[tuple[str, Path, ParallelLayout]],
    batch: dict[str, torch.Tensor],
    batching: MicroBatching,
    params_dtype: torch.dtype = torch.float32,
    extras: tuple[str, ...] = (),
    packed_too: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank: for each (case name, model dir, layout), build, load and compute response log-probs
    (and the `extras`: entropy, sum_pi_squared); `packed_too`: also as packed sequences, as `<name>+packed` (the
    only way under context parallelism)."""
    out = {}
    # one set of process groups per layout, shared by its cases: each set is ~16 gloo groups, whose threads stay
    # for the life of the process (34 cases once left each rank with ~1,600 threads)
    groups_of: dict[ParallelLayout, RoleGroups] = {}
    for name, model_dir, role_layout in cases:
        spec = model_spec(load_hf_config(model_dir))
        if role_layout not in groups_of:
            groups_of[role_layout] = build_role_groups(role_layout)
        groups = groups_of[role_layout]
        model = build_model(spec, groups, params_dtype=params_dtype)
        load_hf_weights(model, groups, SafetensorsReader(model_dir))
        if role_layout.cp == 1:  # context parallelism splits packed sequences only
            out[name] = MegatronEngine(model, groups).forward(batch, batching, extras=extras)
        if packed_too or role_layout.cp > 1:
            out[f"{name}+packed"] = MegatronEngine(model, groups, packing=True).forward(batch, batching, extras=extras)
    return out


def rank_uneven_shares(
    model_dir: Path, role_layout: ParallelLayout, batch: dict[str, torch.Tensor], batching: MicroBatching
) -> tuple[int, dict[str, torch.Tensor]]:
    """On every rank: the log-probs of rows 0..DP rank (an uneven share) packed, and how many micro-batches the
    engine ran (its own count agreed with its expert-parallel peers)."""
    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(role_layout)
    model = build_model(spec, groups)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    engine = MegatronEngine(model, groups, packing=True)
    share = {key: value[: groups.dp_rank + 1] for key, value in batch.items()}
    return len(engine.inputs.split(share, batching)), engine.forward(share, batching)


def rank_random_init(cases: list[tuple[str, Path, MegatronConfig]], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank: for each (case name, model dir, layout), `build_role`'s random init as this rank's HF tensors."""
    from megarl.megatron.weights import gather_hf_weights
    from megarl.workers.base import build_role

    out = {}
    for name, model_dir, megatron in cases:
        model_cfg = ModelConfig(path=str(model_dir), random_init=True, dtype="float32")
        role = build_role(model_cfg, megatron, weights_path=None, seed=seed)
        out[name] = gather_hf_weights(role.model, role.groups)
    return out


def with_training_columns(batch: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return {**batch, "advantages": advantages}


def dp_share(batch: dict[str, torch.Tensor], dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    rows = torch.arange(batch["input_ids"].shape[0]).tensor_split(dp)[dp_rank]
    return {key: value[rows] for key, value in batch.items()}


def _trained_role(
    model_dir: Path,
    role_layout: ParallelLayout,
    batch: dict[str, torch.Tensor],
    batching: MicroBatching,
    optim: object,
    distributed_optimizer: bool,
    params_dtype: torch.dtype = torch.float32,
    packing: bool = False,
) -> tuple:
    """Build `model_dir` under `role_layout` with an optimizer; this rank's DP share with old log-probs (`packing`:
    the engine packs its micro-batches)."""
    from megarl.megatron.optim import make_trainable

    groups = build_role_groups(role_layout)
    model = build_model(model_spec(load_hf_config(model_dir)), groups, params_dtype=params_dtype)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    trainable = make_trainable(model, groups, optim, distributed_optimizer, total_steps=10)
    engine = MegatronEngine(model, groups, trainable, packing=packing)
    share = dp_share(batch, groups.dp_rank, role_layout.dp)
    share["old_log_probs"] = engine.forward(share, batching)["log_probs"]
    return groups, model, trainable, engine, share


def rank_ppo_updates(
    model_dir: Path,
    cases: list[tuple[str, ParallelLayout, MicroBatching, bool, bool]],
    batch: dict[str, torch.Tensor],
    algo: object,
    optim: object,
    distributed_optimizer: bool,
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, float], tuple[int, int, int]]]:
    """Per case (name, layout, micro-batching, offload first, packed): one PPO step from the HF weights on this
    rank's DP share. Returns the updated HF tensors here, the metrics and (bytes before, during and
    after an offload/reload round trip; zeros without offload)."""
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.offload import Offloader, resident_bytes
    from megarl.megatron.weights import gather_hf_weights

    out = {}
    for name, role_layout, batching, offload, packing in cases:
        groups, model, trainable, engine, share = _trained_role(
            model_dir, role_layout, batch, batching, optim, distributed_optimizer, packing=packing
        )
        memory = (0, 0, 0)
        if offload:
            offloader = Offloader(trainable)
            before = resident_bytes(trainable)
            offloader.offload()
            during = resident_bytes(trainable)
            offloader.reload()
            memory = (before, during, resident_bytes(trainable))
        metrics = engine.train_step(share, batching, PolicyLoss(algo))
        out[name] = (gather_hf_weights(model, groups), metrics, memory)
    return out


def rank_role_memory(
    cases: list[tuple[str, Path, ParallelLayout]], batch: dict[str, torch.Tensor], algo: object, optim: object
) -> dict[str, dict[str, int]]:
    """Per case (name, model dir, layout), after one update with the distributed optimizer: this rank's
    parameter count and the bytes of its parameters, gradient buffers and optimizer state."""
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.offload import resident_bytes_by_kind

    batching = MicroBatching(micro_batch_size=2)
    out = {}
    for name, model_dir, role_layout in cases:
        _, _, trainable, engine, share = _trained_role(model_dir, role_layout, batch, batching, optim, True)
        engine.train_step(share, batching, PolicyLoss(algo))
        count = sum(p.numel() for chunk in trainable.chunks for p in chunk.parameters())
        out[name] = {"count": count, **resident_bytes_by_kind(trainable)}
    return out


def _master_bytes(trainable: Trainable) -> int:
    """Bytes of the fp32 master weights the distributed optimizer keeps for bf16/fp16 parameters, read from
    megatron's own groups."""
    optimizers = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    groups = [group for opt in optimizers for group in opt.shard_fp32_from_float16_groups]
    return sum(main.untyped_storage().nbytes() for group in groups for main in group)


def _offload_round_trip(trainable: Trainable) -> dict[str, object]:
    """Offload everything and reload it; then the gradient buffers hold NaN (a reload need not restore them:
    every training step zeroes them first). What each kind and the master weights held before and during, the
    bytes freed and copied to host, and the device memory reserved before and after the offload."""
    from megarl.megatron.offload import Offloader, reserved_bytes, resident_bytes_by_kind

    offloader = Offloader(trainable)
    before, master_before, reserved = resident_bytes_by_kind(trainable), _master_bytes(trainable), reserved_bytes()
    freed = offloader.offload()
    out = {"before": before, "during": resident_bytes_by_kind(trainable), "freed": freed, "host": offloader.host_bytes}
    out |= {"master_before": master_before, "master_during": _master_bytes(trainable)}
    out["reserved"] = (reserved, reserved_bytes())
    offloader.reload()
    for chunk in trainable.chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            buffer.grad_data.fill_(float("nan"))
    return out


def rank_offload_round_trip(
    model_dir: Path,
    role_layout: ParallelLayout,
    batch: dict[str, torch.Tensor],
    algo: object,
    optim: object,
    params_dtype: torch.dtype,
) -> dict[str, object]:
    """Two PPO steps with the distributed optimizer, straight and with `_offload_round_trip` between them: each
    run's HF tensors and step metrics, and the round trip's measurements (`memory`)."""
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.weights import gather_hf_weights

    batching = MicroBatching(micro_batch_size=2)
    out: dict[str, object] = {}
    for run in ("straight", "offloaded"):
        groups, model, trainable, engine, share = _trained_role(
            model_dir, role_layout, batch, batching, optim, True, params_dtype
        )
        metrics = [engine.train_step(share, batching, PolicyLoss(algo))]
        if run == "offloaded":
            out["memory"] = _offload_round_trip(trainable)
        metrics.append(engine.train_step(share, batching, PolicyLoss(algo)))
        out[run] = (gather_hf_weights(model, groups), metrics)
    return out
