"""Routing replay on CUDA + NCCL against transformers' forced routing (fp32); skipped without a GPU (on CPU over
gloo under device_check.sh --dry)."""

from pathlib import Path

import torch
from cases.megatron_cases import layout, sample_batch, save_asset_model
from cases.routing_cases import forced_routing, hf_routing, rank_replay
from gpu_cases import BACKEND, CUDA, needs_device, record

from megarl.megatron.launch import spawn

pytestmark = needs_device


def test_replayed_routing_matches_transformers_on_cuda(tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2) if CUDA else 1
    model_dir = save_asset_model("tiny_moe", tmp_path / "tiny_moe")
    batch = sample_batch(vocab_size=4096)
    natural, _ = hf_routing(model_dir, batch)
    forced = forced_routing(natural, batch["attention_mask"], num_experts=4)
    _, forced_log_probs = hf_routing(model_dir, batch, forced)
    sizes = {"ep": world} if world > 1 else {}
    results = spawn(rank_replay, world, [("device", model_dir, layout(world, **sizes))], batch, forced, backend=BACKEND)
    r = results[0]["device"]
    real = batch["attention_mask"].bool()
    assert torch.equal(r["recorded"][real], natural[real])
    gap = (r["replayed_log_probs"] - forced_log_probs).abs().max().item()
    record("router_replay/forced_routing", max=gap)
    assert gap <= 1e-3
    has = forced >= 0
    assert torch.equal(r["replayed_used"][has], forced[has])
