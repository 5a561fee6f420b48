"""LoRA cases: PEFT adapters on transformers' models as the reference, megarl's megatron adapters on gloo ranks."""

import asyncio
from dataclasses import replace
from pathlib import Path

import peft
import torch
import transformers

from cases.engine_cases import engine_client
from cases.megatron_cases import dp_share, sample_batch, with_training_columns
from cases.sync_cases import NEW_TOKENS, PROMPTS, sample_gap
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.lora import LoraConfig, adapter_name
from megarl.config.sync import SyncConfig
from megarl.config.training import OptimConfig
from megarl.engines.client.sampling import SamplingParams
from megarl.lora.model import adapters_disabled, apply_lora
from megarl.lora.peft_io import gather_adapter, load_adapter_tensors, read_peft
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.losses import PolicyLoss
from megarl.megatron.model import BuiltModel, build_model
from megarl.megatron.optim import make_trainable
from megarl.megatron.parallel import ParallelLayout, RoleGroups, build_role_groups
from megarl.megatron.weights import SafetensorsReader, load_hf_weights
from megarl.models.spec import load_hf_config, model_spec
from megarl.sync.build import build_syncer
from megarl.sync.transport import EngineTarget

TENSOR = SyncConfig(transport="tensor")
"""Handles through shared memory (two syncers in one process cannot both name a broadcast group after the rank)."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(model_dir: Path, out: Path, rank: int, targets: list[str], seed: int = 0) -> Path:
    """A PEFT adapter on `model_dir` with A and B both random (B·A of the order of the weights' scale), saved."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    model.save_pretrained(out)
    return out


@torch.no_grad()
def peft_token_log_probs(model_dir: Path, adapter_dir: Path | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' response log-probs `[b, r]` with a PEFT adapter folder loaded by peft (None: the base)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    mask = batch["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    r = batch["responses"].shape[1]
    log_probs = logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return log_probs * batch["response_mask"]


_GROUPS: dict[ParallelLayout, RoleGroups] = {}
"""One set of process groups per layout in a rank process (each set is ~16 gloo groups that live on)."""


def _groups(role_layout: ParallelLayout) -> RoleGroups:
    if role_layout not in _GROUPS:
        _GROUPS[role_layout] = build_role_groups(role_layout)
    return _GROUPS[role_layout]


def _lora_model(model_dir: Path, groups: RoleGroups, cfg: LoraConfig) -> BuiltModel:
    model = build_model(model_spec(load_hf_config(model_dir)), groups)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    return apply_lora(model, groups, cfg, seed=7)


def rank_adapter_log_probs(
    cases: list[tuple[str, Path, ParallelLayout, list[str]]],
    adapters: dict[Path, Path],
    batch: dict[str, torch.Tensor],
    rank: int,
) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank, per (name, model dir, layout): log-probs with fresh adapters (B = 0), with the adapter of
    `adapters[model dir]` loaded (on `targets`), and the latter with the adapters off; padded, and packed as
    `<name>+packed`."""
    out = {}
    for name, model_dir, role_layout, targets in cases:
        adapter_dir = adapters[model_dir]
        _, tensors = read_peft(adapter_dir)
        groups = _groups(role_layout)
        model = _lora_model(model_dir, groups, LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=targets))
        batching = MicroBatching(micro_batch_size=3)
        engines = {name: MegatronEngine(model, groups), f"{name}+packed": MegatronEngine(model, groups, packing=True)}
        fresh = {key: engine.forward(batch, batching)["log_probs"] for key, engine in engines.items()}
        load_adapter_tensors(model, tensors, str(adapter_dir))
        for key, engine in engines.items():
            with adapters_disabled(model):
                off = engine.forward(batch, batching)["log_probs"]
            out[key] = {"fresh": fresh[key], "adapter": engine.forward(batch, batching)["log_probs"], "off": off}
    return out


def rank_lora_updates(
    model_dir: Path,
    role_layout: ParallelLayout,
    batch: dict[str, torch.Tensor],
    num_updates: int,
    cfg: LoraConfig,
) -> dict[str, object]:
    """On every rank: `num_updates` PPO steps of a LoRA actor on its DP share (packed); returns the adapter (PEFT
    tensors, on rank 0), the log-probs after, this rank's trainable parameters and optimizer-state bytes, and how
    far the base moved."""
    groups = _groups(role_layout)
    model = _lora_model(model_dir, groups, cfg)
    base_before = {n: p.detach().clone() for c in model.chunks for n, p in c.named_parameters() if not p.requires_grad}
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-2, weight_decay=0.0), True, num_updates)
    engine = MegatronEngine(model, groups, trainable, packing=True)
    share = dp_share(with_training_columns(batch), groups.dp_rank, role_layout.dp)
    share["old_log_probs"] = engine.forward(share, MicroBatching(micro_batch_size=2))["log_probs"]
    loss = PolicyLoss(AlgorithmConfig(loss_agg_mode="token-mean"))
    for _ in range(num_updates):
        engine.train_step(share, MicroBatching(micro_batch_size=2), loss)
    moved = max(
        (p.detach() - base_before[n]).abs().max().item()
        for c in model.chunks
        for n, p in c.named_parameters()
        if n in base_before
    )
    trainable_params = sum(p.numel() for c in model.chunks for p in c.parameters() if p.requires_grad)
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for o in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
        for state in o.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    adapter = gather_adapter(model, groups)
    log_probs = engine.forward(batch, MicroBatching(micro_batch_size=3))["log_probs"]
    return {
        "adapter": adapter,
        "log_probs": log_probs,
        "base_moved": moved,
        "trainable_params": trainable_params,
        "optimizer_bytes": optimizer_bytes,
    }


async def _samples(url: str, lora_path: str | None) -> list[tuple[list[int], list[float], str]]:
    client = engine_client(url)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, sampling_seed=3)
    try:
        results = await asyncio.gather(
            *(client.generate(p, sampling, return_logprob=True, lora_path=lora_path) for p in PROMPTS)
        )
    finally:
        await client.close()
    return [(r[0].output_ids, r[0].output_logprobs, r[0].weight_version) for r in results]


def _gap(engine: MegatronEngine, url: str, lora_path: str | None) -> float:
    box: list = [asyncio.run(_samples(url, lora_path)) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return sample_gap(engine, box[0])


def rank_lora_sync_twice(
    model_dir: Path, role_layout: ParallelLayout, adapter_url: str, merged_url: str, rank: int
) -> dict[str, object]:
    """A LoRA actor trains a step and syncs its adapter into one engine (`sync=adapter`, sampled naming the
    adapter) and merged weights into another (`sync=merged`), twice; the trainer-vs-engine gap of each per round,
    and each sync's metrics."""
    groups = _groups(role_layout)
    cfg = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=["all-linear"])
    model = _lora_model(model_dir, groups, cfg)
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-2, weight_decay=0.0), False, 10)
    engine = MegatronEngine(model, groups, trainable)
    syncers = {
        mode: build_syncer(
            model, groups, TENSOR, "colocated", [EngineTarget(url)], torch.float32, lora=replace(cfg, sync=mode)
        )
        for mode, url in (("adapter", adapter_url), ("merged", merged_url))
    }
    out: dict[str, object] = {}
    for round_ in (1, 2):
        batch = with_training_columns(sample_batch(model.spec.vocab_size, num_rows=4, seed=round_))
        batch["old_log_probs"] = engine.forward(batch, MicroBatching(micro_batch_size=4))["log_probs"]
        engine.train_step(batch, MicroBatching(micro_batch_size=4), PolicyLoss(AlgorithmConfig()))
        for mode, syncer in syncers.items():
            out[f"{round_}/{mode}/metrics"] = syncer.sync(weight_version=f"v{round_}")
        out[f"{round_}/adapter"] = _gap(engine, adapter_url, adapter_name(f"v{round_}"))
        out[f"{round_}/merged"] = _gap(engine, merged_url, None)
        out[f"{round_}/adapter_off"] = _gap(engine, adapter_url, None)  # the base: far from the trained policy
    for syncer in syncers.values():
        syncer.close()
    return out
