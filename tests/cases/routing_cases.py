"""transformers' own MoE routing (natural or forced) as the reference for routing replay, and the per-rank
function of the multi-process replay tests."""

import asyncio
from pathlib import Path
from typing import Any

import torch
import transformers

from cases.engine_cases import randomize, router_of
from megarl.assets import asset_path
from megarl.batch import NO_RECORD, Batch
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.model import build_model
from megarl.megatron.parallel import ParallelLayout, build_role_groups
from megarl.megatron.weights import SafetensorsReader, load_hf_weights
from megarl.models.spec import load_hf_config, model_spec


def _gate_hook(layer: int, forced: torch.Tensor | None, seen: dict[int, torch.Tensor]) -> Any:
    """A forward hook on the router of MoE layer `layer` (its ordinal among the MoE layers) of a Qwen3-MoE model
    (`Qwen3MoeTopKRouter`: returns logits, weights, indices over batch-major tokens) that records its indices, or
    replaces them with `forced [b·s, moe_layers, k]` where ≥ 0."""

    def hook(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
        logits, weights, indices = output
        if forced is not None:
            target = forced[:, layer].long()
            indices = torch.where(target[:, :1] >= 0, target, indices)
            probs = logits.float().softmax(dim=-1).gather(1, indices)
            weights = (probs / probs.sum(dim=-1, keepdim=True) if module.norm_topk_prob else probs).to(weights.dtype)
        seen[layer] = indices
        return logits, weights, indices

    return hook


@torch.no_grad()
def hf_routing(
    model_dir: Path, batch: dict[str, torch.Tensor], forced: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing `[b, s, moe_layers, k]` that transformers used, -1 off the attention mask; response log-probs
    `[b, r]`), with `forced [b, s, moe_layers, k]` replacing its own top-k wherever forced ≥ 0. Dense layers (no
    `mlp.gate`) have no entries."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    b, s = batch["input_ids"].shape
    flat = None if forced is None else forced.reshape(b * s, *forced.shape[2:])
    seen: dict[int, torch.Tensor] = {}
    moe = [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for j, layer in enumerate(moe):
        layer.mlp.gate.register_forward_hook(_gate_hook(j, flat, seen))
    mask = batch["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    r = batch["responses"].shape[1]
    log_probs = logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    routing = torch.stack([seen[i] for i in range(len(seen))], dim=1).reshape(b, s, len(seen), -1)
    routing = routing.masked_fill(mask[:, :, None, None] == 0, NO_RECORD)
    return routing.to(torch.int16), log_probs * batch["response_mask"]


def rank_replay(
    cases: list[tuple[str, Path, ParallelLayout, bool]], batch: dict[str, torch.Tensor], forced: torch.Tensor
) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank, per case (name, model, layout, packed): the routing the trainer records, and log-probs with no
    replay, replaying its own record, and replaying `forced` (with the mismatch counts of both replays, and the
    experts the routers used)."""
    out = {}
    batching = MicroBatching(micro_batch_size=4)
    for name, model_dir, role_layout, packing in cases:
        spec = model_spec(load_hf_config(model_dir))
        groups = build_role_groups(role_layout)
        model = build_model(spec, groups, params_dtype=torch.float32)
        load_hf_weights(model, groups, SafetensorsReader(model_dir))
        engine = MegatronEngine(model, groups, packing=packing)
        engine.enable_routing_replay()
        recorded = engine.forward(batch, batching, record_routing=True)
        own = engine.forward(batch | {"routed_experts": recorded["routed_experts"]}, batching)
        replayed = engine.forward(batch | {"routed_experts": forced.flatten(2)}, batching, record_routing=True)
        out[name] = {
            "recorded": recorded["routed_experts"].view(forced.shape),
            "log_probs": recorded["log_probs"],
            "own_log_probs": own["log_probs"],
            "own_mismatch": own["routing_mismatch"],
            "replayed_log_probs": replayed["log_probs"],
            "replayed_used": replayed["routed_experts"].view(forced.shape),
            "replayed_mismatch": replayed["routing_mismatch"],
            "replayed_tokens": replayed["routing_tokens"],
        }
    return out


def rank_r2_updates(
    model_dir: Path,
    cases: list[tuple[str, ParallelLayout, bool]],
    batch: dict[str, torch.Tensor],
    algo: Any,
    optim: Any,
) -> dict[str, dict[str, Any]]:
    """R2 on every rank, per case (name, layout, packed): the old-log-prob pass records the routing, then two
    optimizer steps replay it; returns the record and both steps' metrics."""
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.optim import make_trainable

    out = {}
    batching = MicroBatching(micro_batch_size=4)
    for name, role_layout, packing in cases:
        groups = build_role_groups(role_layout)
        spec = model_spec(load_hf_config(model_dir))
        model = build_model(spec, groups)
        load_hf_weights(model, groups, SafetensorsReader(model_dir))
        trainable = make_trainable(model, groups, optim, False, total_steps=10)
        engine = MegatronEngine(model, groups, trainable, packing=packing)
        engine.enable_routing_replay()
        rows = torch.arange(batch["input_ids"].shape[0]).tensor_split(role_layout.dp)[groups.dp_rank]
        share = {key: value[rows] for key, value in batch.items()}
        recorded = engine.forward(share, batching, record_routing=True)
        share |= {"old_log_probs": recorded["log_probs"], "routed_experts": recorded["routed_experts"]}
        steps = [engine.train_step(share, batching, PolicyLoss(algo)) for _ in range(2)]
        recorded_by_layer = recorded["routed_experts"].view(len(rows), -1, spec.num_moe_layers, spec.moe_topk)
        out[name] = {"recorded": recorded_by_layer, "rows": rows, "steps": steps}
    return out


def dense_first_moe(path: Path) -> Path:
    """tiny_moe grown to 4 decoder layers, the first dense (`mlp_only_layers=[0]`, as DeepSeek-V3's and GLM-4.5's
    `first_k_dense_replace=1`): MoE ordinals 0..2 are decoder layers 1..3; under PP2 the stages hold one dense and
    one MoE layer, and two MoE layers."""
    config = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_moe"))
    config.num_hidden_layers, config.mlp_only_layers = 4, [0]
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed=5)
    model.save_pretrained(path)
    return path


def rank_reference(model_dir: Path, batch: dict[str, torch.Tensor], forced: torch.Tensor) -> dict[str, torch.Tensor]:
    """A reference policy under R3 (`replays_routing`) on PP2, packed: its log-probs with `forced [b, s, moe_layers,
    k]` as the batch's `routed_experts`, and its engine's live log-probs and recorded routing (R2's column)."""
    from megarl.config.model import ModelConfig
    from megarl.config.training import MegatronConfig
    from megarl.workers.reference import ReferencePolicy
    from megarl.workers.settings import ModelSettings, ReferenceSettings

    model = ModelSettings(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        megatron=MegatronConfig(pipeline_model_parallel_size=2),
        weights_path=str(model_dir),
        seed=0,
    )
    micro = MicroBatching(micro_batch_size=4)
    settings = ReferenceSettings(model=model, micro=micro, temperature=1.0, offload=False, replays_routing=True)
    reference = ReferencePolicy(settings)
    replayed = reference.log_probs(Batch.from_dict(batch | {"routed_experts": forced.flatten(2)}))
    live = reference.role.engine.forward(batch, micro, record_routing=True)
    return {"replayed": replayed["ref_log_probs"], "live": live["log_probs"], "recorded": live["routed_experts"]}


def perturbed_routers(model_dir: Path, out_dir: Path, scale: float, seed: int = 0) -> Path:
    """A copy of `model_dir` whose MoE routers (`mlp.gate.weight`) carry N(0, scale²) noise: an engine that routes
    some tokens differently from the trainer, deterministically."""
    import shutil

    import safetensors.torch

    out_dir.mkdir(parents=True)
    shutil.copy(model_dir / "config.json", out_dir / "config.json")
    tensors = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = tensor + scale * torch.randn(tensor.shape, generator=g)
    safetensors.torch.save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


async def multi_turn_rollouts(url: str, num_samples: int, model_dir: Path) -> Any:
    """`num_samples` tool-loop trajectories of 3 model turns (8 tokens each) with the gsm8k interaction's user turns
    between them, asking the engine for routed experts; the padded batch (`agents.postprocess.to_batch`, the routing
    laid out for `model_dir`'s MoE layers)."""
    from transformers import AutoTokenizer

    from megarl.agents.base import AgentContext, AgentSample
    from megarl.agents.chat_tokens import ChatTokens
    from megarl.agents.interactions.gsm8k import Gsm8kInteraction
    from megarl.agents.postprocess import RoutingLayout, to_batch
    from megarl.agents.tool_loop import ToolAgentLoop
    from megarl.assets import asset_path
    from megarl.config.rollout import MultiTurnConfig
    from megarl.engines.client.sampling import SamplingParams

    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    router = router_of([url])
    context = AgentContext(
        router=router,
        chat=chat,
        response_length=48,
        multi_turn=MultiTurnConfig(max_assistant_turns=3, max_new_tokens_per_turn=8),
        interactions={"gsm8k": Gsm8kInteraction({"max_attempts": 5})},
    )
    loop = ToolAgentLoop(context)
    runs = []
    for i in range(num_samples):
        messages = [{"role": "user", "content": f"What is {i} + {i + 3}?"}]
        prompt_ids = chat.encode(messages, add_generation_prompt=True)
        sample = AgentSample(
            sample_id=f"r3-{i}",
            prompt_ids=prompt_ids,
            messages=messages,
            interaction_kwargs={"name": "gsm8k", "ground_truth": str(2 * i + 3)},
            seed=i,
            routed_experts=True,
        )
        runs.append(loop.run(sample, SamplingParams(temperature=1.0)))
    try:
        outputs = await asyncio.gather(*runs)
    finally:
        await router.close()
    layout = RoutingLayout.of(str(model_dir))
    return to_batch(list(outputs), prompt_length=48, response_length=48, pad_token_id=0, routing=layout)


def rank_r3(
    model_dir: Path, cases: list[tuple[str, ParallelLayout, bool]], batch: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """R3 on every rank, per case (name, layout, packed): log-probs and the experts used without replay, and
    replaying the engine's `routed_experts` (with the mismatch counts)."""
    out = {}
    batching = MicroBatching(micro_batch_size=4)
    for name, role_layout, packing in cases:
        groups = build_role_groups(role_layout)
        model = build_model(model_spec(load_hf_config(model_dir)), groups)
        load_hf_weights(model, groups, SafetensorsReader(model_dir))
        engine = MegatronEngine(model, groups, packing=packing)
        engine.enable_routing_replay()
        live = engine.forward({k: v for k, v in batch.items() if k != "routed_experts"}, batching, record_routing=True)
        replayed = engine.forward(batch, batching, record_routing=True)
        out[name] = {
            "live_log_probs": live["log_probs"],
            "live_routing": live["routed_experts"],
            "log_probs": replayed["log_probs"],
            "used_routing": replayed["routed_experts"],
            "mismatch": replayed["routing_mismatch"],
            "tokens": replayed["routing_tokens"],
        }
    return out


def forced_routing(natural: torch.Tensor, attention_mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`natural` with every even position's experts shifted by one, and no record for each row's last token."""
    forced = natural.clone()
    even = torch.arange(natural.shape[1]) % 2 == 0
    shifted = (forced[:, even].long() + 1) % num_experts
    forced[:, even] = torch.where(forced[:, even] >= 0, shifted, NO_RECORD).to(forced.dtype)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(dim=1)
    forced[torch.arange(len(last)), last] = NO_RECORD
    return forced
