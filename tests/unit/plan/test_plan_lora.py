"""megarl-plan with LoRA on the actor (`actor.lora`): the trainable parameters against `adapter_param_count` and
hand counts, the split of adapters over TP and EP, the actor's memory (frozen base, trained adapters) against full
fine-tuning, no reference memory, the sync bytes, the report, and the gate's LoRA problems."""

import pytest
from conftest import compose_config

from megarl.config import ConfigError, MegarlConfig
from megarl.config.training import MegatronConfig
from megarl.lora.targets import adapter_param_count, lora_targets
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.adapters import adapter_shard
from megarl.plan.gate import validate
from megarl.plan.lora import lora_budget
from megarl.plan.memory import role_memory
from megarl.plan.params import DeviceShard, count_params
from megarl.plan.report import build_plan, format_plan, sync_seconds

TINY = ("trainer=cpu", "trainer.devices_per_node=4")
QWEN_7B = ("+experiment=qwen2_5_7b_tp4",)
"""Qwen2.5-7B on 1 node × 8 GPUs, actor TP=4."""


def _cfg(model: str, rank: int, *overrides: str) -> MegarlConfig:
    """`model` (a tiny one on 4 CPU devices, or qwen2_5_7b as `QWEN_7B`) with LoRA at `rank` on every linear layer."""
    base = QWEN_7B if model == "qwen2_5_7b" else (f"model={model}", *TINY)
    return compose_config(*base, f"actor.lora.rank={rank}", *overrides)


def test_tiny_dense_trainable_params_by_hand() -> None:
    """tiny_dense (hidden 64, 4 heads × 16, 2 KV heads, MLP 128, 2 layers), every linear layer at rank 8: each
    projection gets A [8, in] and B [out, 8], 8·(in + out) parameters."""
    cfg = _cfg("tiny_dense", 8)
    attention = (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)  # q, k, v, o
    mlp = (64 + 128) + (64 + 128) + (128 + 64)  # gate, up, down
    assert lora_budget(cfg).trainable_params == 2 * 8 * (attention + mlp) == 16384


@pytest.mark.parametrize(("model", "rank"), [("tiny_dense", 8), ("tiny_moe", 8), ("qwen2_5_7b", 16)])
def test_trainable_params_equal_adapter_count(model: str, rank: int) -> None:
    cfg = _cfg(model, rank)
    spec = model_spec(load_hf_config(cfg.model.path))
    budget = lora_budget(cfg)
    assert budget.trainable_params == adapter_param_count(lora_targets(spec, ["all-linear"]), rank)
    assert budget.full_params == count_params(spec).total
    assert budget.optimizer_bytes < budget.full_optimizer_bytes
    assert budget.optimizer_bytes_per_device < budget.full_optimizer_bytes_per_device


def test_adapters_split_over_tp_and_ep_by_hand() -> None:
    """TP=2: a column-parallel layer (QKV, gate/up) keeps A whole and halves B, a row-parallel one (o, down) halves
    A and keeps B whole. tiny_moe at EP=2: each rank holds 2 of the 4 experts' adapters."""
    cfg = _cfg("tiny_dense", 16, "actor.megatron.tensor_model_parallel_size=2")
    spec, lora, tp2 = model_spec(load_hf_config(cfg.model.path)), cfg.actor.lora, cfg.actor.megatron
    qkv, o = 3 * 64 + (64 + 32 + 32) // 2, 64 // 2 + 64
    gate_up, down = 2 * 64 + 2 * 128 // 2, 128 // 2 + 64
    assert adapter_shard(spec, lora, tp2) == DeviceShard(dense=2 * 16 * (qkv + o + gate_up + down), expert=0)
    assert adapter_shard(spec, lora, tp2).total == 23552
    moe_cfg = _cfg("tiny_moe", 8, "actor.megatron.expert_model_parallel_size=2")
    moe = model_spec(load_hf_config(moe_cfg.model.path))
    attention = (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)
    expert = (64 + 32) + (64 + 32) + (32 + 64)  # gate, up, down of one expert (width 32)
    shard = adapter_shard(moe, moe_cfg.actor.lora, moe_cfg.actor.megatron)
    assert shard == DeviceShard(dense=2 * 8 * attention, expert=2 * 8 * 2 * expert)


def test_actor_memory_by_hand_and_no_reference() -> None:
    """tiny_dense in fp32 at TP=2 on 4 devices (DP=2), rank 16: the base weights without gradients or optimizer
    state, the adapters with both; the reference takes nothing."""
    cfg = _cfg("tiny_dense", 16, "actor.megatron.tensor_model_parallel_size=2")
    (ref,) = [m for m in build_plan(cfg).memory if m.name == "ref"]
    assert (ref.params, ref.grads, ref.optimizer, ref.activations, ref.offloaded) == (0, 0, 0, 0, 0)
    spec = model_spec(load_hf_config(cfg.model.path))
    counts = count_params(spec)
    base = 2 * (2 * 64 + (64 * 128 + 128 + 64 * 64 + 3 * 64 * 128) // 2) + 2 * 4096 * 64 // 2 + 64
    adapters = 23552
    actor = role_memory("actor", cfg, spec, counts, cfg.actor.megatron, num_devices=4)
    assert actor.params == (base + adapters) * 4
    assert actor.grads == adapters * 4
    assert actor.optimizer == adapters * 8 / 2  # m and v in fp32 (no master copy of fp32 params), over DP=2
    cfg.actor.lora.rank = 0
    full = role_memory("actor", cfg, spec, counts, cfg.actor.megatron, num_devices=4)
    assert actor.state < full.state and (full.grads, full.optimizer) == (base * 4, base * 8 / 2)


@pytest.mark.parametrize(("model", "rank"), [("tiny_dense", 8), ("tiny_moe", 8), ("qwen2_5_7b", 16)])
def test_lora_actor_below_full_fine_tuning(model: str, rank: int) -> None:
    lora, full = build_plan(_cfg(model, rank)), build_plan(_cfg(model, 0))
    assert lora.memory[0].name == full.memory[0].name == "actor"
    assert lora.memory[0].state < full.memory[0].state
    assert [m.state for m in lora.memory if m.name == "ref"] == [0]
    assert all(p.training < q.training for p, q in zip(lora.peaks.values(), full.peaks.values(), strict=True))


def test_sync_bytes_adapter_vs_full() -> None:
    """The adapters move each update, full size in the engine dtype; merged moves the whole model as without LoRA.
    tiny_dense at rank 16: 32768 of 598592 params, 5.47% (its 4096 × 64 embedding and output layer are 88% of it);
    Qwen2.5-7B at rank 16: 40.37M of 7.62B, 0.53%."""
    tiny = lora_budget(_cfg("tiny_dense", 16))
    assert (tiny.adapter_sync_bytes, tiny.full_sync_bytes) == (32768 * 4, 598592 * 4)  # fp32
    assert tiny.adapter_sync_bytes / tiny.full_sync_bytes == pytest.approx(0.0547, abs=1e-4)
    cfg = _cfg("qwen2_5_7b", 16)
    qwen = lora_budget(cfg)
    assert qwen.adapter_sync_bytes == 40370176 * 2  # bf16
    ratio = qwen.adapter_sync_bytes / qwen.full_sync_bytes
    assert ratio == pytest.approx(0.0053, abs=1e-4) and ratio <= 0.02
    spec = model_spec(load_hf_config(cfg.model.path))
    counts = count_params(spec)
    adapter = sync_seconds(cfg, spec, counts)
    cfg.actor.lora.sync = "merged"
    merged = sync_seconds(cfg, spec, counts)
    cfg.actor.lora.rank = 0
    assert adapter < merged / 50 and merged == sync_seconds(cfg, spec, counts)


def test_report_and_shipped_lora_experiment() -> None:
    """`+experiment=lora_qwen2_5_7b`: rank 64 on every linear layer at TP=4, 74.09M adapter params per device
    (QKV and gate/up: A whole, B ÷ 4; o and down: A ÷ 4, B whole)."""
    plan = build_plan(compose_config("+experiment=lora_qwen2_5_7b"))
    qkv, o = 3 * 3584 + (3584 + 2 * 512) // 4, 3584 // 4 + 3584  # hidden 3584, 4 KV heads × 128
    gate_up, down = 2 * 3584 + 2 * 18944 // 4, 18944 // 4 + 3584  # MLP 18944
    assert plan.lora is not None
    assert plan.lora.trainable_params_per_device == 28 * 64 * (qkv + o + gate_up + down) == 74088448
    assert plan.fits
    text = format_plan(plan)
    assert "ref        the actor with its adapters off (actor.lora): no weights of its own" in text
    assert "lora       actor.lora: rank 64, alpha 128 on all-linear, sync=adapter" in text
    assert "trainable 0.16B of 7.62B params (2.12%), 74.09M of 1.90B per device" in text
    assert "sync 0.3 GB per update (the adapters) vs 15.2 GB merged (2.12%)" in text
    merged = format_plan(build_plan(compose_config("+experiment=lora_qwen2_5_7b", "actor.lora.sync=merged")))
    assert "sync 15.2 GB per update (merged) vs 0.3 GB with actor.lora.sync=adapter (2.12%)" in merged
    assert "lora  " not in format_plan(build_plan(compose_config("+experiment=qwen2_5_7b_tp4")))


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(*TINY, *overrides), check_files=False)
    return str(info.value)


MOE_TP2 = ("model=tiny_moe", "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("model=tiny_dense", "actor.lora.rank=8", "actor.lora.target_modules=[w1,w3]"),
            "actor.lora.target_modules=['w1', 'w3'] matches no layer of qwen2; it has down_proj, gate_proj, k_proj, "
            "o_proj, q_proj, up_proj, v_proj (or all-linear)",
        ),
        (("model=tiny_dense", "actor.lora.rank=8", "actor.lora.alpha=0"), "actor.lora.alpha=0.0 must be > 0"),
        (
            ("model=tiny_dense", "critic.lora.rank=8"),
            "critic.lora.rank=8: LoRA trains the actor only; a value model trains every weight: set critic.lora.rank=0",
        ),
        (
            (*MOE_TP2, "actor.lora.rank=8", "actor.lora.sync=merged"),
            "actor.lora.target_modules=['all-linear'] adapts the experts' down_proj, gate_proj, up_proj, whose "
            "adapters need expert-TP 1, but actor.megatron.expert_tensor_parallel_size=None (follows "
            "actor.megatron.tensor_model_parallel_size=2): set actor.megatron.expert_tensor_parallel_size=1, or leave",
        ),
        (
            (*MOE_TP2, "actor.megatron.expert_tensor_parallel_size=2", "actor.lora.rank=8", "actor.lora.sync=merged"),
            "but actor.megatron.expert_tensor_parallel_size=2: set actor.megatron.expert_tensor_parallel_size=1",
        ),
        (
            (
                "model=tiny_dense",
                "actor.megatron.tensor_model_parallel_size=2",
                "actor.lora.rank=8",
                "actor.lora.dropout=0.1",
            ),
            "actor.lora.dropout=0.1 with actor.megatron.tensor_model_parallel_size=2: an adapter's input is replicated "
            "over the TP ranks, so its dropout would need a TP-synchronised RNG; set actor.lora.dropout=0",
        ),
        (
            ("model=tiny_moe", "actor.lora.rank=8", "rollout.engine=embedded", "actor.lora.sync=adapter"),
            "actor.lora.sync=adapter with rollout.engine=embedded: the embedded engine applies adapters through peft, "
            "which cannot adapt transformers' fused expert tensors (down_proj, gate_proj, up_proj of the experts); "
            "set actor.lora.sync=merged, or leave",
        ),
        (
            ("model=tiny_dense", "actor.lora.rank=8", "+rollout.engine_kwargs.max_lora_rank=4"),
            "rollout.engine_kwargs.max_lora_rank=4 < actor.lora.rank=8: the engines would refuse the adapter",
        ),
        (
            ("model=tiny_dense", "actor.lora.rank=8", "+rollout.engine_kwargs.enable_lora=false"),
            "rollout.engine_kwargs.enable_lora=False: actor.lora.sync=adapter loads each step's adapter into engines "
            "started with --enable-lora",
        ),
        (
            ("model=tiny_dense", "actor.lora.rank=8", "trainer.save_hf_weights=true"),
            "trainer.save_hf_weights with actor.lora.rank > 0 and model.random_init=true: the HF export merges the "
            "adapters into model.path's weights, which a random-init model does not have on disk",
        ),
    ],
)
def test_gate_refuses(overrides: tuple[str, ...], message: str) -> None:
    problems = _problems(*overrides)
    assert message in problems
    assert "1 problem)" in problems, problems


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=tiny_dense", "actor.megatron.tensor_model_parallel_size=2", "actor.lora.rank=8"),
        (*MOE_TP2, "actor.megatron.expert_tensor_parallel_size=1", "actor.lora.rank=8", "actor.lora.sync=merged"),
        (*MOE_TP2, "actor.lora.rank=8", "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"),
        ("model=tiny_moe", "actor.lora.rank=8", "actor.lora.sync=merged", "actor.lora.dropout=0.05"),
    ],
)
def test_gate_accepts(overrides: tuple[str, ...]) -> None:
    validate(compose_config(*TINY, *overrides), check_files=False)


def test_gate_refuses_a_reference_layout_of_its_own() -> None:
    cfg = compose_config(*TINY, "model=tiny_dense", "actor.lora.rank=8")
    cfg.ref.megatron = MegatronConfig()
    with pytest.raises(ConfigError, match="ref.megatron is set but actor.lora.rank > 0: a LoRA actor's reference"):
        validate(cfg, check_files=False)
