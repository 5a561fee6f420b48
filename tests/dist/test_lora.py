"""LoRA on megatron-core over gloo (4 ranks), against peft's adapters on transformers' models."""

from dataclasses import replace
from pathlib import Path

import pytest
from cases.engine_cases import start_engine
from cases.lora_cases import (
    TARGETS,
    peft_token_log_probs,
    rank_adapter_log_probs,
    rank_lora_sync_twice,
    rank_lora_updates,
    save_random_adapter,
)
from cases.megatron_cases import layout, rank_calls, sample_batch, save_asset_model, save_random_model
from conftest import compose_config

from megarl.config import MegarlConfig
from megarl.config.lora import LoraConfig
from megarl.convert.lora import merge_lora
from megarl.engines.replicas.launch import LoraServing
from megarl.lora.peft_io import adapter_config, save_peft, short_names
from megarl.lora.targets import adapter_param_count, lora_targets
from megarl.megatron.launch import spawn
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.lora import lora_budget

WORLD = 4
RANK = 4
ATTENTION = TARGETS[:4]
"""MoE models: transformers 5 fuses the experts into 3-D tensors, which peft cannot adapt per expert."""
LAYOUTS = {
    "qwen2": {"tp2sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2}},
    "qwen3_moe": {"ep2tp2": {"ep": 2, "tp": 2}},
}


def _layout(sizes: dict) -> object:
    role_layout = layout(WORLD, **sizes)
    return replace(role_layout, etp=1) if "ep" in sizes else role_layout  # expert adapters need expert-TP 1


@pytest.mark.slow
def test_adapters_match_peft_before_and_after_training(tmp_path: Path) -> None:
    """B = 0 gives the base model; a PEFT adapter loaded into megatron's layers gives peft's log-probs at TP2+SP,
    PP2 and EP2×TP2, padded and packed; three PPO updates train the adapters only, the same under TP2+SP and
    PP2; their PEFT export loaded by peft, and merged into the base (MoE experts' adapters too), gives the trainer's
    log-probs."""
    batch = sample_batch(vocab_size=250, num_rows=8)
    models = {arch: save_random_model(arch, tmp_path / arch) for arch in LAYOUTS}
    targets = {"qwen2": TARGETS, "qwen3_moe": ATTENTION}
    adapters = {models[a]: save_random_adapter(models[a], tmp_path / f"{a}_adapter", RANK, targets[a]) for a in LAYOUTS}
    cases = [
        (f"{arch}/{name}", models[arch], _layout(sizes), targets[arch])
        for arch, layouts in LAYOUTS.items()
        for name, sizes in layouts.items()
    ]
    train_cfg = LoraConfig(rank=RANK, alpha=2.0 * RANK, target_modules=TARGETS)
    calls = [(rank_adapter_log_probs, (cases, adapters, batch, RANK))]
    calls += [
        (rank_lora_updates, (models["qwen2"], _layout(s), batch, 3, train_cfg)) for s in LAYOUTS["qwen2"].values()
    ]
    moe_cfg = replace(train_cfg, target_modules=ATTENTION)
    moe_all = replace(train_cfg, target_modules=["all-linear"])  # each expert's adapters too (peft cannot load them)
    for cfg in (moe_cfg, moe_all):
        calls.append((rank_lora_updates, (models["qwen3_moe"], _layout({"ep": 2, "tp": 2}), batch, 3, cfg)))
    results = spawn(rank_calls, WORLD, calls)
    forward, *updates = results[0]
    for name, model_dir, _, _ in cases:
        base = peft_token_log_probs(model_dir, None, batch)
        with_adapter = peft_token_log_probs(model_dir, adapters[model_dir], batch)
        assert (with_adapter - base).abs().max() > 0.5  # the adapter matters
        for key in (name, f"{name}+packed"):
            out = forward[key]
            assert (out["fresh"] - out["off"]).abs().max() <= 1e-6, key  # B = 0: the base, to the last bit
            assert (out["off"] - base).abs().max() <= 1e-4, key
            assert (out["adapter"] - with_adapter).abs().max() <= 1e-4, key
    spec = model_spec(load_hf_config(models["qwen2"]))
    full_count = adapter_param_count(lora_targets(spec, TARGETS), RANK)
    trained = [("qwen2", train_cfg)] * 2 + [("qwen3_moe", moe_cfg), ("qwen3_moe_experts", moe_all)]
    for i, ((arch, cfg), rank0) in enumerate(zip(trained, updates, strict=True)):
        model_dir = models[arch.removesuffix("_experts")]
        assert rank0["base_moved"] == 0.0, "the base weights must stay frozen"
        assert max(t.abs().max().item() for n, t in rank0["adapter"].items() if "lora_B" in n) > 1e-3  # B trained
        config = adapter_config(cfg, short_names(rank0["adapter"]))
        exported = save_peft(tmp_path / f"export_{i}", config, rank0["adapter"])
        merge_lora(exported, model_dir, tmp_path / f"merged_{i}")
        checks = {"merged": peft_token_log_probs(tmp_path / f"merged_{i}", None, batch)}
        if arch != "qwen3_moe_experts":
            checks["peft"] = peft_token_log_probs(model_dir, exported, batch)
        for how, log_probs in checks.items():
            diff = (log_probs - rank0["log_probs"]).abs().max().item()
            assert diff <= 1e-4, f"{arch}: {how} export vs the trainer: max |Δ log p| = {diff}"
    tp2sp, pp2 = (u["adapter"] for u in updates[:2])
    assert sum(t.numel() for t in tp2sp.values()) == full_count
    assert max((tp2sp[n] - pp2[n]).abs().max().item() for n in tp2sp) <= 1e-3
    # TP2+SP: A replicated and B split on column layers, A split and B replicated on row ones, DP 2; the planner
    # (megarl-plan) counts the same trainable parameters per device and optimizer state (Adam's two moments, sharded
    # over DP by the distributed optimizer, padded to its buckets)
    tp_rank_share = [rank_results[1]["trainable_params"] for rank_results in results]
    assert tp_rank_share[0] == tp_rank_share[1] < full_count and sum(tp_rank_share[:2]) > full_count
    planned = lora_budget(_planned(models["qwen2"]))
    assert planned.trainable_params == full_count and planned.trainable_params_per_device == tp_rank_share[0]
    measured_optimizer = max(rank_results[1]["optimizer_bytes"] for rank_results in results)
    assert measured_optimizer == pytest.approx(planned.optimizer_bytes_per_device, rel=0.05)
    assert planned.optimizer_bytes_per_device < 0.2 * planned.full_optimizer_bytes_per_device


def _planned(model_dir: Path) -> MegarlConfig:
    """The TP2+SP case as a run's config (4 CPU devices, DP 2), for megarl-plan's LoRA budget."""
    return compose_config(
        "model=tiny_dense",
        f"model.path={model_dir}",
        "trainer=cpu",
        "trainer.devices_per_node=4",
        f"actor.lora.rank={RANK}",
        f"actor.lora.target_modules=[{','.join(TARGETS)}]",
        "actor.megatron.tensor_model_parallel_size=2",
        "actor.megatron.sequence_parallel=true",
    )


@pytest.mark.slow
def test_adapter_and_merged_syncs_give_the_engines_the_trainers_policy_twice(tmp_path: Path) -> None:
    """A TP2 LoRA actor trains and syncs twice: its adapter into an engine started with --enable-lora (sampled
    naming the version's adapter) and its merged weights into a plain one; both engines give the trainer's
    log-probs, and the adapter sync moves a fraction of the merged sync's bytes after the first."""
    model_dir = save_asset_model("tiny_dense", tmp_path / "tiny_dense")
    serving = LoraServing(max_rank=16, target_modules=("all-linear",))
    started = [start_engine(model_dir, tmp_path, "--load-format", "dummy", *flags) for flags in (serving.flags, ())]
    try:
        (_, adapter_url), (_, merged_url) = started
        out = spawn(rank_lora_sync_twice, 2, model_dir, layout(2, tp=2), adapter_url, merged_url, 16)[0]
    finally:
        for server, _ in started:
            server.stop()
    for round_ in (1, 2):
        assert out[f"{round_}/adapter"] <= 1e-4 and out[f"{round_}/merged"] <= 1e-4, out
        assert out[f"{round_}/adapter_off"] > 1e-2, "the trained adapter must change the policy"
    first, second, merged = out["1/adapter/metrics"], out["2/adapter/metrics"], out["2/merged/metrics"]
    assert first.bytes > merged.bytes  # the first adapter sync carries the base too
    assert second.bytes == pytest.approx(
        adapter_param_count(lora_targets(model_spec(load_hf_config(model_dir)), ["all-linear"]), 16) * 4
    )
    assert second.bytes / merged.bytes < 0.06  # 5.5 %: the tiny model's embedding and LM head are 88 % of it
