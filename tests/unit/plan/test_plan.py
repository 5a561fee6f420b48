"""megarl-plan: parameter counts against transformers and published sizes, memory against hand
computations, the shipped large-model experiments, and the layouts it refuses."""

import pytest
import torch
from conftest import compose_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from megarl.assets import asset_path
from megarl.cli.plan import main as plan_main
from megarl.config import MegatronConfig
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.memory import activation_bytes, engine_memory, role_memory
from megarl.plan.params import DeviceShard, LayerCounts, count_params, device_shard
from megarl.plan.report import build_plan


def _counts(name: str):
    return count_params(model_spec(load_hf_config(asset_path(f"models/{name}"))))


def test_tiny_counts_by_hand() -> None:
    # tiny_dense: hidden 64, 2 layers, 4 heads × 16, 2 KV heads, MLP 128, vocab 4096, untied, QKV bias.
    attention = 64 * (64 + 2 * 32) + (64 + 2 * 32) + 64 * 64
    layer = attention + 3 * 64 * 128 + 2 * 64
    assert _counts("tiny_dense").total == 2 * layer + 2 * 4096 * 64 + 64 == 598592
    # tiny_moe: no bias, QK-norms (2 × 16), router 64 × 4, 4 experts of width 32, top-2.
    moe = _counts("tiny_moe")
    expert = 3 * 64 * 32
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 + 2 * 16 + 64 * 4 + 4 * expert
    assert moe.total == 2 * layer + 2 * 4096 * 64 + 64 == 598912
    assert moe.active == moe.total - 2 * 2 * expert


REAL_MODELS = [
    "qwen2_5_7b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "qwen1_5_moe_a2_7b",
    "qwen2_57b_a14b",
    "glm4_5_air",
    "moonlight_16b_a3b",
    "deepseek_v3",
    "qwen2_5_vl_7b",
    "qwen3_vl_8b",
]


@pytest.mark.parametrize(
    "name",
    [
        "tiny_dense",
        "tiny_moe",
        "tiny_qwen2_moe",
        "tiny_glm4_moe",
        "tiny_deepseek_v3",
        "tiny_qwen2_5_vl",
        "tiny_qwen3_vl",
        *REAL_MODELS,
    ],
)
def test_counts_equal_transformers(name: str) -> None:
    """Every shipped config; transformers builds no multi-token-prediction layer and keeps the sigmoid
    routers' `e_score_correction_bias` as a buffer, as the planner counts them."""
    config = AutoConfig.from_pretrained(asset_path(f"models/{name}"))
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    assert _counts(name).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "total", "active", "with_embeddings"),
    [
        ("qwen2_5_7b", 7.61e9, 7.61e9, True),  # Qwen2.5 report: 7.61B
        ("qwen3_30b_a3b", 30.5e9, 3.3e9, True),  # Qwen3 report: 30.5B total, 3.3B activated
        ("qwen3_235b_a22b", 235e9, 22e9, True),  # Qwen3 report: 235B total, 22B activated
        ("qwen1_5_moe_a2_7b", 14.3e9, 2.7e9, True),  # Qwen1.5-MoE blog: 14.3B total, 2.7B activated
        ("qwen2_57b_a14b", 57e9, 14e9, True),  # Qwen2 report: 57B total, 14B activated
        ("deepseek_v3", 671e9, 37e9, True),  # DeepSeek-V3 report: 671B total, 37B activated (MTP module aside)
        ("moonlight_16b_a3b", 15.29e9, 2.24e9, False),  # Moonlight report: 15.29B / 2.24B, embeddings excluded
        ("glm4_5_air", 106e9 - 1.24e9, 12e9, False),  # GLM-4.5 report: 106B total, 12B activated (no embeddings)
        ("qwen2_5_vl_7b", 8.29e9, 8.29e9, True),  # the Qwen2.5-VL-7B model card: 8.29B
        ("qwen3_vl_8b", 8.77e9, 8.77e9, True),  # the Qwen3-VL-8B-Instruct model page: 8.77B
    ],
)
def test_published_counts(name: str, total: float, active: float, with_embeddings: bool) -> None:
    counts = _counts(name)
    embeddings = 0 if with_embeddings else counts.embedding + counts.output
    assert counts.total - embeddings == pytest.approx(total, rel=0.01)
    assert counts.active - embeddings == pytest.approx(active, rel=0.02)


def test_mla_counts_by_hand() -> None:
    """Moonlight: 27 layers, the first dense; MLA without a Q down projection; 64 experts top-6 + 2 shared."""
    counts = _counts("moonlight_16b_a3b")
    h, heads = 2048, 16
    sharded = h * heads * 192 + 512 * heads * (128 + 128) + heads * 128 * h  # q_proj, kv_b_proj, o_proj
    # kv_a_proj_with_mqa (the KV latent and the shared RoPE key), kv_a_layernorm, input and pre-MLP norms
    replicated = h * (512 + 64) + 512 + 2 * h
    dense, moe = counts.layers[0], counts.layers[1]
    assert (dense.replicated, dense.sharded, dense.experts) == (replicated, sharded + 3 * h * 11264, 0)
    expert = 3 * h * 1408
    assert (moe.replicated, moe.sharded) == (replicated + h * 64, sharded + 2 * expert)
    assert (moe.experts, moe.active_experts) == (64 * expert, 6 * expert)
    assert counts.layers[1:] == (moe,) * 26
    # DeepSeek-V3 adds the Q down projection (q_a_proj, q_a_layernorm) and Q up projection (q_b_proj).
    v3 = _counts("deepseek_v3").layers[0]
    assert v3.replicated == 7168 * 1536 + 1536 + 7168 * (512 + 64) + 512 + 2 * 7168


def test_device_shard_by_hand() -> None:
    layout = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    shard = device_shard(_counts("tiny_moe"), layout)
    # Per layer: norms + router whole, attention halved; embedding and output halved (4096 pads to
    # 4096 = a multiple of 128 × 2); experts split EP × ETP = 2 × 2 (ETP defaults to TP).
    per_layer = (2 * 64 + 2 * 16 + 64 * 4) + (64 * 128 + 64 * 64) // 2
    assert shard.dense == 2 * per_layer + 2 * 4096 * 64 // 2 + 64
    assert shard.expert == 2 * 4 * 3 * 64 * 32 // 4


def test_device_shard_dense_first_layer() -> None:
    """Moonlight at TP=2 PP=3 EP=8: the first stage holds the embedding and the dense first layer (a wide MLP
    instead of experts), the last the output layer; MLA's down projections are whole on every TP rank."""
    counts = _counts("moonlight_16b_a3b")
    mp = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, expert_model_parallel_size=8)
    dense, moe = counts.layers[0], counts.layers[1]
    vocab_shard = 163840 * 2048 // 2

    def layer(x: LayerCounts) -> int:
        return x.replicated + x.sharded // 2

    first = DeviceShard(dense=vocab_shard + layer(dense) + 8 * layer(moe), expert=8 * moe.experts // 16)
    last = DeviceShard(dense=9 * layer(moe) + vocab_shard + 2048, expert=9 * moe.experts // 16)
    assert device_shard(counts, mp) == max(first, last, key=lambda shard: shard.total) == last


def test_memory_by_hand() -> None:
    cfg = compose_config(
        "model=tiny_dense",
        "trainer=cpu",
        "trainer.devices_per_node=4",
        "actor.megatron.tensor_model_parallel_size=2",
        "data.max_prompt_length=100",
        "data.max_response_length=28",
        "actor.ppo_micro_batch_size_per_device=2",
    )
    spec = model_spec(load_hf_config(cfg.model.path))
    counts = count_params(spec)
    actor = role_memory("actor", cfg, spec, counts, cfg.actor.megatron, num_devices=4)
    params = 2 * (2 * 64 + (64 * 128 + 128 + 64 * 64 + 3 * 64 * 128) // 2) + 2 * 4096 * 64 // 2 + 64
    assert actor.params == params * 4  # fp32
    assert actor.grads == params * 4
    assert actor.optimizer == params * 8 / 2  # m and v, split over DP = 4 / TP 2
    assert actor.offloaded == actor.params + actor.grads + actor.optimizer  # colocated actor
    tokens = 2 * 128
    per_token = 4 * 64 + (2 * 64 + 2 * 32) / 2 + 3 * 128 / 2
    logits = 4096 / 2 * (tokens * 4 + tokens * 4 * 3)
    assert actor.activations == tokens * per_token * 4 * 2 + logits
    ref = role_memory("ref", cfg, spec, counts, cfg.actor.megatron, num_devices=4)
    assert (ref.params, ref.grads, ref.optimizer, ref.offloaded) == (params * 4, 0, 0, 0)
    cfg.ref.offload = cfg.critic.offload = True
    assert role_memory("ref", cfg, spec, counts, cfg.actor.megatron, num_devices=4).offloaded == params * 4
    critic = role_memory("critic", cfg, spec, counts, cfg.critic.megatron, num_devices=4)
    assert critic.offloaded == critic.params + critic.grads + critic.optimizer > 0
    engine = engine_memory(cfg, spec, counts)
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V × layers × KV heads × head dim × fp32
    assert engine.weights == counts.total * 4
    cfg.trainer.placement = "separate"  # no engine on these devices: nothing to make room for
    assert role_memory("actor", cfg, spec, counts, cfg.actor.megatron, num_devices=4).offloaded == 0


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        plan_main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


QWEN3_30B_2X8 = [
    "model=qwen3_30b_a3b",
    "rollout=sglang",
    "trainer.nnodes=2",
    "trainer.devices_per_node=8",
    "actor.megatron.tensor_model_parallel_size=2",
    "actor.megatron.expert_model_parallel_size=8",
    "actor.megatron.sequence_parallel=true",
    "actor.ppo_micro_batch_size_per_device=1",
    "rollout.tensor_parallel_size=4",
    "data.max_prompt_length=1024",
    "data.max_response_length=3072",
]


def test_qwen3_30b_fits_two_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, *QWEN3_30B_2X8, "plan.device_memory_gb=80")
    assert code == 0, out
    assert "30.53B total, 3.35B active" in out
    assert "2 node(s) × 8 cuda devices" in out
    assert "actor      TP=2 PP=1 CP=1 DP=8; experts EP=8 ETP=2 EDP=1" in out
    assert "4 replica(s) of 4 device(s)" in out
    assert "verdict    fits" in out
    cfg = compose_config(*QWEN3_30B_2X8)
    plan = build_plan(cfg)
    (peaks,) = plan.peaks.values()
    assert peaks.training <= 80e9 and peaks.rollout <= 80e9
    # The same layout on 40 GB devices does not fit, and says so with exit status 1.
    code, out, _ = _plan(capsys, *QWEN3_30B_2X8, "plan.device_memory_gb=40")
    assert code == 1
    assert "DOES NOT FIT" in out


def test_separate_pools_in_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """One machine split between the pools (the CPU demo), and two nodes, one per pool."""
    one_machine = (
        "trainer.placement=separate",
        "trainer.rollout_devices=1",
        "actor.megatron.tensor_model_parallel_size=1",
    )
    code, out, err = _plan(capsys, "--config-name", "demo_cpu", "model=tiny_dense", *one_machine)
    assert code == 0, out + err
    assert "pools      train: 1 device(s), node 0 device 0 .. node 0 device 0: actor, ref\n" in out
    assert "rollout: 1 device(s), node 0 device 1 .. node 0 device 1: 1 embedded replica(s)" in out
    assert "broadcast: each owner rank broadcasts its buckets to every engine rank (gloo)" in out
    two_nodes = (
        "trainer.placement=separate",
        "trainer.rollout_devices=8",
        "actor.megatron.expert_model_parallel_size=4",
    )
    _, out, err = _plan(capsys, *QWEN3_30B_2X8, *two_nodes)
    assert "train: 8 device(s), node 0 device 0 .. node 0 device 7: actor, ref" in out, err
    assert "rollout: 8 device(s), node 1 device 0 .. node 1 device 7: 2 sglang replica(s)" in out
    assert "replica 1: node 1 device 4 .. node 1 device 7" in out
    _, out, _ = _plan(capsys, *QWEN3_30B_2X8)
    assert (
        "pools      shared: 16 device(s), node 0 device 0 .. node 1 device 7: actor, ref and 4 sglang replica(s)" in out
    )
    # one node: the broadcast stays inside it, as fast as the colocated hand-over
    one_node = build_plan(compose_config("+experiment=qwen2_5_7b_tp4", *one_machine[:1], "trainer.rollout_devices=4"))
    assert one_node.sync_seconds == build_plan(compose_config("+experiment=qwen2_5_7b_tp4")).sync_seconds


def test_async_overlap_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    """Rooflines: training time ∝ 1 / train_tflops, rollout time ∝ response budget / hbm_gbps; overlapped is
    max(rollout, training) + sync, in sequence their sum; megarl-plan prints it for asynchronous modes."""
    separate = (
        *QWEN3_30B_2X8,
        "trainer.placement=separate",
        "trainer.rollout_devices=8",
        "actor.megatron.expert_model_parallel_size=4",
        "trainer.driver=fully_async",
    )
    base = build_plan(compose_config(*separate)).step
    faster = build_plan(compose_config(*separate, "plan.train_tflops=800", "plan.hbm_gbps=5000")).step
    longer = build_plan(compose_config(*separate, "data.max_response_length=2048")).step
    cfg = compose_config(*separate)
    assert faster.train_s == pytest.approx(base.train_s / 2) and faster.rollout_s == pytest.approx(base.rollout_s / 2)
    assert longer.rollout_s == pytest.approx(base.rollout_s * 2048 / cfg.data.max_response_length)
    assert base.overlapped_s == pytest.approx(max(base.rollout_s, base.train_s) + base.sync_s)
    assert base.sequential_s == pytest.approx(base.rollout_s + base.train_s + base.sync_s)
    # by hand: 30.53B weights in bf16 read once per decode step by a replica of 4 devices at 2500 GB/s
    step_s = 30.53e9 * 2 / (4 * 2500e9)
    assert base.rollout_s == pytest.approx(cfg.data.max_response_length * step_s, rel=1e-3)
    _, out, _ = _plan(capsys, *separate)
    assert "async      fully_async: per step ~" in out and "overlapped vs" in out
    _, out, _ = _plan(capsys, *QWEN3_30B_2X8)
    assert "async      " not in out  # synchronous runs overlap nothing


@pytest.mark.parametrize(
    "experiment",
    [
        "qwen2_5_7b_tp4",
        "lora_qwen2_5_7b",
        "qwen3_30b_a3b_2x8",
        "qwen3_235b_a22b_16x8",
        "qwen1_5_moe_a2_7b_1x8",
        "qwen2_57b_a14b_4x8",
        "moonlight_16b_a3b_1x8",
        "glm4_5_air_8x8",
        "deepseek_v3_64x8",
        "qwen2_5_vl_7b_tp4",
        "qwen3_vl_8b_tp4",
    ],
)
def test_shipped_experiments_fit(capsys: pytest.CaptureFixture[str], experiment: str) -> None:
    code, out, err = _plan(capsys, f"+experiment={experiment}")
    assert code == 0, out + err
    assert "verdict    fits" in out
    peaks = build_plan(compose_config(f"+experiment={experiment}")).peaks
    assert all(max(p.training, p.rollout) <= 80e9 for p in peaks.values())


def test_mla_memory_by_hand() -> None:
    """Moonlight at TP=2 (sequence parallel), experts whole (ETP=1): activations of the dense first layer and
    of an MoE layer with MLA and shared experts; the engine's KV cache is SGLang's MLA latent."""
    cfg = compose_config("+experiment=moonlight_16b_a3b_1x8")
    spec = model_spec(load_hf_config(cfg.model.path))
    mp = cfg.actor.megatron
    h, tokens = 2048, 4096
    attention = (2 * 512 + 64) + 16 * (2 * 192 + 2 * 128) / 2  # latents whole on each TP rank; Q, K, V, output
    dense = 4 * h / 2 + attention + 3 * 11264 / 2
    moe = 4 * h / 2 + attention + 64 / 2 + 6 / 2 * (2 * h + 3 * 1408) + 3 * 2816 / 2
    expected = tokens * (dense + 26 * moe) * 2  # bf16
    assert activation_bytes(spec, mp, tokens, in_flight=1, act_bytes=2, logits=False) == pytest.approx(expected)
    engine = engine_memory(cfg, spec, count_params(spec))
    assert engine.kv_bytes_per_token == 27 * (512 + 64) * 2  # one latent + RoPE key per layer, bf16
    cfg.rollout.tensor_parallel_size = 4  # TP splits heads, not the latent: each rank keeps all of it
    assert engine_memory(cfg, spec, count_params(spec)).kv_bytes_per_token == engine.kv_bytes_per_token


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.megatron.expert_model_parallel_size=7"], "expert_model_parallel_size=7 must divide the model's 128"),
        (["actor.megatron.tensor_model_parallel_size=3"], "tensor_model_parallel_size=3 must divide the model's 32"),
        (["actor.megatron.expert_tensor_parallel_size=5"], "expert_tensor_parallel_size=5 splits each expert"),
        (["trainer.devices_per_node=6", "actor.megatron.tensor_model_parallel_size=4"], "must divide the 12"),
    ],
)
def test_refused_layouts(capsys: pytest.CaptureFixture[str], overrides: list[str], message: str) -> None:
    code, out, err = _plan(capsys, *QWEN3_30B_2X8, *overrides)
    assert code == 2
    assert out == ""
    assert message in err


def test_a_frozen_vision_tower_takes_no_gradient_or_optimizer_state() -> None:
    """Qwen2.5-VL-7B at TP4: the frozen tower's 0.68B parameters (replicated on every TP rank) leave the actor's
    gradient buffer and Adam state; trained, they are back (fp32 gradient: 4 bytes each)."""
    frozen = build_plan(compose_config("+experiment=qwen2_5_vl_7b_tp4"))
    trained = build_plan(compose_config("+experiment=qwen2_5_vl_7b_tp4", "model.freeze_vision_tower=false"))
    actor_frozen, actor_trained = (next(m for m in p.memory if m.name == "actor") for p in (frozen, trained))
    assert frozen.counts.vision == 676_550_144
    assert actor_trained.grads - actor_frozen.grads == pytest.approx(4 * frozen.counts.vision)
    assert actor_trained.params == actor_frozen.params


def test_a_vision_language_model_plans_with_context_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny VL config keeps its language model under `text_config` (transformers 5): read from there."""
    cp = ["actor.megatron.context_parallel_size=2", "actor.megatron.sequence_packing=true"]
    code, out, err = _plan(capsys, "model=tiny_qwen2_5_vl", *cp)
    assert code == 0, out + err
    assert "of which the vision tower" in out


def test_deepstack_layers_must_sit_on_the_first_pipeline_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """Tiny Qwen3-VL adds deepstack features after decoder layers 0 and 1 (of 4): PP2 keeps both on stage 0, PP4
    does not unless the first stage is given two layers."""
    assert _plan(capsys, "model=tiny_qwen3_vl", "actor.megatron.pipeline_model_parallel_size=2")[0] == 0
    code, _, err = _plan(capsys, "model=tiny_qwen3_vl", "actor.megatron.pipeline_model_parallel_size=4")
    assert code == 2 and "num_layers_in_first_pipeline_stage >= 2" in err


def test_lora_is_refused_for_a_vision_language_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _plan(capsys, "model=tiny_qwen3_vl", "actor.lora.rank=8")
    assert code == 2 and "LoRA is not supported for vision-language models (qwen3_vl)" in err
