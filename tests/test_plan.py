"""megarl-plan: parameter counts against transformers and published sizes, memory against hand
computations, the shipped large-model experiments, and the layouts it refuses."""

from pathlib import Path

import pytest
import torch
from conftest import compose_config
from megatron_cases import layout, rank_role_memory, save_asset_model, with_training_columns
from transformers import AutoConfig, AutoModelForCausalLM

from megarl.assets import asset_path
from megarl.cli.plan import main as plan_main
from megarl.config import MegatronConfig
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.megatron.launch import spawn
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.memory import engine_memory, role_memory
from megarl.plan.params import count_params, device_shard
from megarl.plan.report import build_plan

WORLD = 4


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


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "qwen2_5_7b", "qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_counts_equal_transformers(name: str) -> None:
    config = AutoConfig.from_pretrained(asset_path(f"models/{name}"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert _counts(name).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("qwen2_5_7b", 7.61e9, 7.61e9),  # Qwen2.5 report: 7.61B
        ("qwen3_30b_a3b", 30.5e9, 3.3e9),  # Qwen3 report: 30.5B total, 3.3B activated
        ("qwen3_235b_a22b", 235e9, 22e9),  # Qwen3 report: 235B total, 22B activated
    ],
)
def test_published_counts(name: str, total: float, active: float) -> None:
    counts = _counts(name)
    assert counts.total == pytest.approx(total, rel=0.005)
    assert counts.active == pytest.approx(active, rel=0.02)


def test_device_shard_by_hand() -> None:
    layout = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    shard = device_shard(_counts("tiny_moe"), layout)
    # Per layer: norms + router whole, attention halved; embedding and output halved (4096 pads to
    # 4096 = a multiple of 128 × 2); experts split EP × ETP = 2 × 2 (ETP defaults to TP).
    per_layer = (2 * 64 + 2 * 16 + 64 * 4) + (64 * 128 + 64 * 64) // 2
    assert shard.dense == 2 * per_layer + 2 * 4096 * 64 // 2 + 64
    assert shard.expert == 2 * 4 * 3 * 64 * 32 // 4


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
    code, out, err = _plan(capsys, "--config-name", "demo_cpu", *one_machine)
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
        "async_training.mode=fully_async",
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


@pytest.mark.parametrize("experiment", ["qwen2_5_7b_tp4", "qwen3_30b_a3b_2x8", "qwen3_235b_a22b_16x8"])
def test_shipped_experiments_fit(capsys: pytest.CaptureFixture[str], experiment: str) -> None:
    code, out, err = _plan(capsys, f"+experiment={experiment}")
    assert code == 0, out + err
    assert "verdict    fits" in out


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


def test_memory_matches_megatron(tmp_path: Path) -> None:
    """Real megatron-core on 4 gloo ranks: the count and bytes of parameters, gradient buffers and Adam
    state on each rank against the plan (buffers are padded, hence the small tolerance)."""
    cases = {
        "moe_tp2_ep2": ("tiny_moe", layout(WORLD, tp=2, ep=2)),
        "moe_ep2": ("tiny_moe", layout(WORLD, ep=2)),
        "dense_tp2_pp2": ("tiny_dense", layout(WORLD, tp=2, pp=2)),
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
        cfg = compose_config(f"model={model}", "trainer=cpu", f"trainer.devices_per_node={WORLD}")
        spec = model_spec(load_hf_config(cfg.model.path))
        planned = role_memory("actor", cfg, spec, count_params(spec), mp, WORLD)
        ranks = [result[name] for result in results]
        fullest = max(ranks, key=lambda rank: rank["count"])
        assert fullest["count"] == device_shard(count_params(spec), mp).total, name
        assert fullest["params"] == pytest.approx(planned.params, rel=0.03), name
        assert fullest["grads"] == pytest.approx(planned.grads, rel=0.03), name
        assert max(rank["optimizer"] for rank in ranks) == pytest.approx(planned.optimizer, rel=0.03), name
