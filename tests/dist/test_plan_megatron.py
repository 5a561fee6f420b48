"""megarl-plan against real megatron-core models on 4 gloo processes: per-device parameter shards and the memory a
role's ranks allocate."""

from pathlib import Path

import pytest
import torch
from cases.megatron_cases import layout, rank_role_memory, save_asset_model, with_training_columns
from conftest import compose_config

from megarl.assets import asset_path
from megarl.config import MegatronConfig
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.megatron.launch import spawn
from megarl.megatron.model import build_model
from megarl.megatron.parallel import ParallelLayout, build_role_groups
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.memory import role_memory
from megarl.plan.params import count_params, device_shard

WORLD = 4


def rank_param_counts(cases: list[tuple[str, Path, ParallelLayout]]) -> dict[str, int]:
    """Per case (name, model dir, layout): the parameters megarl's Megatron model holds on this rank."""
    out = {}
    for name, model_dir, role_layout in cases:
        built = build_model(model_spec(load_hf_config(model_dir)), build_role_groups(role_layout))
        out[name] = sum(p.numel() for chunk in built.chunks for p in chunk.parameters())
    return out


def test_shard_matches_megatron_models() -> None:
    """megarl's Megatron models of the sigmoid-routed families on 4 gloo ranks: the parameters on the fullest
    rank equal the plan's (MLA's down projections whole on each TP rank, the dense first layer on stage 0;
    the expert bias a buffer)."""
    cases = {
        "mla_tp2_ep2": ("tiny_deepseek_v3", layout(WORLD, tp=2, ep=2)),
        "mla_pp2_ep2": ("tiny_deepseek_v3", layout(WORLD, pp=2, ep=2)),
        "glm_tp2_ep2": ("tiny_glm4_moe", layout(WORLD, tp=2, ep=2)),
    }
    runs = [(name, asset_path(f"models/{model}"), lay) for name, (model, lay) in cases.items()]
    results = spawn(rank_param_counts, WORLD, runs)
    for name, (model, lay) in cases.items():
        mp = MegatronConfig(
            tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp, expert_model_parallel_size=lay.ep
        )
        counts = count_params(model_spec(load_hf_config(asset_path(f"models/{model}"))))
        assert max(result[name] for result in results) == device_shard(counts, mp).total, name


def test_memory_matches_megatron(tmp_path: Path) -> None:
    """Real megatron-core on 4 gloo ranks: the count and bytes of parameters, gradient buffers and Adam
    state on each rank against the plan (buffers are padded, hence the small tolerance)."""
    cases = {
        "moe_tp2_ep2": ("tiny_moe", layout(WORLD, tp=2, ep=2)),
        "moe_ep2": ("tiny_moe", layout(WORLD, ep=2)),
        "dense_tp2_pp2": ("tiny_dense", layout(WORLD, tp=2, pp=2)),
        "qwen2_moe_tp2_ep2": ("tiny_qwen2_moe", layout(WORLD, tp=2, ep=2)),  # the shared expert's gate
    }
    # Every row full length: on CPU megatron's allgather MoE dispatcher needs equal token counts per EP rank.
    ids = torch.randint(1, 4096, (8, 16), generator=torch.Generator().manual_seed(0))
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 7:]}
    batch = with_training_columns({**full, "response_mask": torch.ones_like(ids[:, 7:])})
    runs = [(name, save_asset_model(model, tmp_path / name), lay) for name, (model, lay) in cases.items()]
    adam = OptimConfig(name="adam", lr=1e-3)
    results = spawn(rank_role_memory, WORLD, runs, batch, AlgorithmConfig(), adam)
    for name, (model, role_layout) in cases.items():
        mp = MegatronConfig(
            tensor_model_parallel_size=role_layout.tp,
            pipeline_model_parallel_size=role_layout.pp,
            expert_model_parallel_size=role_layout.ep,
            sequence_parallel=role_layout.sequence_parallel,
        )
        model_path = f"model.path={asset_path(f'models/{model}')}"
        cfg = compose_config("model=tiny_moe", model_path, "trainer=cpu", f"trainer.devices_per_node={WORLD}")
        spec = model_spec(load_hf_config(cfg.model.path))
        planned = role_memory("actor", cfg, spec, count_params(spec), mp, WORLD)
        ranks = [result[name] for result in results]
        fullest = max(ranks, key=lambda rank: rank["count"])
        assert fullest["count"] == device_shard(count_params(spec), mp).total, name
        assert fullest["params"] == pytest.approx(planned.params, rel=0.03), name
        assert fullest["grads"] == pytest.approx(planned.grads, rel=0.03), name
        assert max(rank["optimizer"] for rank in ranks) == pytest.approx(planned.optimizer, rel=0.03), name
