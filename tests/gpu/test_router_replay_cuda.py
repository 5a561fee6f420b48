"""Routing replay on CUDA + NCCL against transformers' forced routing (fp32); skipped without a GPU."""

from pathlib import Path

import pytest
import torch
from megatron_cases import layout, sample_batch, save_asset_model
from routing_cases import hf_routing, rank_replay
from test_router_replay import _forced

from megarl.megatron.launch import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_replayed_routing_matches_transformers_on_cuda(tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2)
    model_dir = save_asset_model("tiny_moe", tmp_path / "tiny_moe")
    batch = sample_batch(vocab_size=4096)
    natural, _ = hf_routing(model_dir, batch)
    forced = _forced(natural, batch["attention_mask"], num_experts=4)
    _, forced_log_probs = hf_routing(model_dir, batch, forced)
    sizes = {"ep": world} if world > 1 else {}
    results = spawn(rank_replay, world, [("cuda", model_dir, layout(world, **sizes))], batch, forced, backend="nccl")
    r = results[0]["cuda"]
    real = batch["attention_mask"].bool()
    assert torch.equal(r["recorded"][real], natural[real])
    assert (r["replayed_log_probs"] - forced_log_probs).abs().max() <= 1e-3
    has = forced >= 0
    assert torch.equal(r["replayed_used"][has], forced[has])
