"""megarl-plan with packed micro-batches and context parallelism: the fullest micro-batch packed and padded, the
padding share under the assumed lengths against hand computations, and the CP a 32k-token trajectory of
Qwen3-30B-A3B needs."""

from dataclasses import replace

import pytest
from conftest import compose_config

from megarl.config import MegatronConfig
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.facts import training_devices
from megarl.plan.memory import activation_bytes, micro_batch_tokens, role_memory
from megarl.plan.padding import computed_tokens, expert_peers, padding
from megarl.plan.params import count_params
from megarl.plan.report import build_plan, format_plan

TINY = ("model=tiny_dense", "trainer=cpu", "trainer.devices_per_node=4")

QWEN3_30B_32K = (
    "model=qwen3_30b_a3b",
    "rollout=sglang",
    "trainer.nnodes=4",
    "trainer.devices_per_node=8",
    "actor.megatron.tensor_model_parallel_size=2",
    "actor.megatron.expert_model_parallel_size=8",
    "actor.megatron.sequence_parallel=true",
    "actor.ppo_micro_batch_size_per_device=1",
    "rollout.tensor_parallel_size=4",
    "data.max_prompt_length=1024",
    "data.max_response_length=31744",
)
"""A 32768-token agentic trajectory on 4 nodes × 8 GPUs: TP=2 with sequence parallelism, experts EP=8 × ETP=2."""


def test_fullest_micro_batch_rounds_rows_up() -> None:
    """The fullest micro-batch: every row full length (fixed count) or the budget filled (rounded down to the
    alignment), each row rounded up to TP × 2·CP; a trajectory longer than the budget runs alone."""
    lengths = ("data.max_prompt_length=100", "data.max_response_length=29")  # 129 tokens
    layout = ("actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true")
    cp2 = compose_config(*TINY, *lengths, *layout, "actor.megatron.context_parallel_size=2")
    cp2.actor.ppo_micro_batch_size_per_device = 3
    assert micro_batch_tokens(cp2, "actor") == 3 * 136  # 129 → 136, a multiple of TP 2 × 2·CP 2
    cp2.actor.use_dynamic_bsz = True
    cp2.actor.ppo_max_token_len_per_device = 1007
    assert micro_batch_tokens(cp2, "actor") == 1000
    cp2.actor.ppo_max_token_len_per_device = 130
    assert micro_batch_tokens(cp2, "actor") == 136
    no_cp = compose_config(*TINY, *lengths, *layout, "actor.ppo_micro_batch_size_per_device=3")
    assert micro_batch_tokens(no_cp, "actor") == 3 * 130  # a multiple of TP 2


def test_packed_peak_equals_padded_and_cp_divides_it() -> None:
    """The same budget or row count gives the same peak packed or padded (the fullest micro-batch fills it either
    way); CP gives each rank 1/CP of its tokens."""
    cfg = compose_config(*TINY, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_device=4096")
    spec = model_spec(load_hf_config(cfg.model.path))
    counts = count_params(spec)
    packed = role_memory("actor", cfg, spec, counts, cfg.actor.megatron, 4)
    padded_mp = replace(cfg.actor.megatron, sequence_packing=False)
    assert role_memory("actor", cfg, spec, counts, padded_mp, 4).activations == packed.activations
    per_token = activation_bytes(spec, cfg.actor.megatron, 1, in_flight=1, act_bytes=4, logits=False)
    assert packed.activations > 4096 * per_token  # plus the logits
    cp2 = MegatronConfig(context_parallel_size=2)
    assert activation_bytes(spec, cp2, 4096, 1, 4, True) == activation_bytes(spec, MegatronConfig(), 2048, 1, 4, True)


def _uniform_max_mean(top: int, rows: int) -> float:
    """E[max of `rows` draws uniform on 1..top]."""
    return sum(r * ((r / top) ** rows - ((r - 1) / top) ** rows) for r in range(1, top + 1))


def test_padding_share_against_order_statistics() -> None:
    """Dense, no expert-parallel peers, 4 rows per micro-batch, prompts of 1 token and responses uniform on
    1..1000: padded computes 4 × E[longest of 4] per micro-batch for 4 × E[length] real tokens; packed computes
    only the real ones, plus each row's rounding up to TP=2 under sequence parallelism."""
    cfg = compose_config(*TINY, "data.max_prompt_length=1", "data.max_response_length=1000")
    cfg.actor.ppo_micro_batch_size_per_device = 4
    share = padding(cfg, model_spec(load_hf_config(cfg.model.path)), "actor")
    exact = 1 - (1 + 500.5) / (1 + _uniform_max_mean(1000, 4))
    assert exact == pytest.approx(0.3743, abs=1e-4)
    assert share.padded == pytest.approx(exact, abs=0.005)
    assert (share.packed, share.peers) == (0.0, 1)
    cfg.actor.megatron.tensor_model_parallel_size, cfg.actor.megatron.sequence_parallel = 2, True
    odd = 0.5 / (1 + 500.5)  # half the rows are odd-length and gain one token
    assert padding(cfg, model_spec(load_hf_config(cfg.model.path)), "actor").packed == pytest.approx(odd, rel=0.1)


def test_padding_budget_and_expert_peers_by_hand() -> None:
    """Two expert-parallel peers agree on each micro-batch's length (and a padded one's width); the budget
    counts rows × longest padded, the sum packed."""
    cfg = compose_config(*TINY)
    cfg.actor.ppo_micro_batch_size_per_device = 2
    lengths = [10, 3, 7, 2]  # peer 0 holds [10, 3], peer 1 [7, 2]
    assert computed_tokens(cfg, "actor", lengths, rows=2, peers=2, packed=False) == 4 * 10
    assert computed_tokens(cfg, "actor", lengths, rows=2, peers=2, packed=True) == 2 * 13
    assert computed_tokens(cfg, "actor", lengths, rows=2, peers=1, packed=True) == 22
    cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_device = True, 14
    # first-fit, longest first: padded [10], [7, 3] (2 × 7 ≤ 14), [2]; packed [10, 3], [7, 2]
    assert computed_tokens(cfg, "actor", [10, 3, 7, 2], rows=4, peers=1, packed=False) == 10 + 2 * 7 + 2
    assert computed_tokens(cfg, "actor", [10, 3, 7, 2], rows=4, peers=1, packed=True) == 22
    qwen3 = compose_config(*QWEN3_30B_32K)
    spec = model_spec(load_hf_config(qwen3.model.path))
    assert expert_peers(spec, qwen3.actor.megatron) == 8  # ETP 2 × EP 8 ranks, TP 2 of them share rows
    assert expert_peers(spec, replace(qwen3.actor.megatron, expert_tensor_parallel_size=1)) == 4
    assert expert_peers(spec, replace(qwen3.actor.megatron, context_parallel_size=8)) == 1


def test_qwen3_30b_32k_needs_cp8_on_80gb() -> None:
    """One 32768-token trajectory per micro-batch on Qwen3-30B-A3B (4 × 8 GPUs, TP=2, EP=8): 168 GB of activations
    at CP=1; CP=8 is the smallest that fits 80 GB, CP=2 fits 141 GB (H200), none fits 40 GB."""
    cfg = compose_config(*QWEN3_30B_32K)
    plan = build_plan(cfg)
    need = plan.context["actor"]
    assert (need.tokens, need.cp, need.at) == (32768, 8, 8)
    assert need.peak <= 80e9
    spec, mp = plan.spec, cfg.actor.megatron
    at_cp1 = activation_bytes(spec, mp, 32768, in_flight=1, act_bytes=2, logits=True)
    assert at_cp1 == pytest.approx(168.4e9, rel=1e-3)
    assert need.activations == activation_bytes(spec, replace(mp, context_parallel_size=8), 32768, 1, 2, True)
    layers = [activation_bytes(spec, replace(mp, context_parallel_size=c), 32768, 1, 2, False) for c in (1, 8)]
    assert layers[1] == layers[0] / 8  # the layers' share; the logits' fp32 chunk stays 4096 tokens
    # CP=4 does not fit 80 GB: the state left after the other roles, with the optimizer sharded over DP=4
    cp4 = replace(mp, context_parallel_size=4)
    actor4 = role_memory("actor", cfg, spec, plan.counts, cp4, training_devices(cfg), tokens=32768)
    ref = next(m for m in plan.memory if m.name == "ref")
    assert 4e9 + actor4.state + ref.state + actor4.activations > 80e9
    assert build_plan(compose_config(*QWEN3_30B_32K, "plan.device_memory_gb=141")).context["actor"].cp == 2
    assert build_plan(compose_config(*QWEN3_30B_32K, "plan.device_memory_gb=40")).context["actor"].cp is None


def test_report_long_context_lines() -> None:
    """megarl-plan's long-context and padding lines for the 32k trajectory, and the verdict's CP hint."""
    out = format_plan(build_plan(compose_config(*QWEN3_30B_32K)))
    assert (
        "long ctx   actor: a 32768-token trajectory alone in a micro-batch needs CP≥8 on 80 GB devices "
        "(CP=8: activations 24.3 GB, training peak 64.6 GB)\n" in out
    )
    assert "one full-length trajectory needs actor.megatron.context_parallel_size ≥ 8" in out
    assert "(each micro-batch as long as the longest of 8 expert-parallel peers'); runs packed\n" in out
    assert "(padding with prompt and response lengths each uniform on 1..max: megarl-plan reads no data)" in out
    two_nodes = format_plan(build_plan(compose_config(*QWEN3_30B_32K, "trainer.nnodes=2")))
    assert "fits at no CP ≤ 8 on 80 GB devices (CP=8: activations 24.3 GB, training peak 80.1 GB)" in two_nodes
    assert "no actor.megatron.context_parallel_size fits one full-length trajectory: add devices" in two_nodes


def test_report_shipped_experiments_lines() -> None:
    """A dense model packs away its padding; the MoE actor packs under routing replay too, and may take CP."""
    dense = format_plan(build_plan(compose_config("+experiment=qwen2_5_7b_tp4")))
    assert "long ctx   actor: a 3072-token trajectory alone in a micro-batch fits without CP on 80 GB" in dense
    assert "           padding: 20.4% of computed tokens padded, 0.1% packed; runs packed\n" in dense
    long = ("trainer.nnodes=4", "data.max_response_length=31744")
    replayed = format_plan(build_plan(compose_config("+experiment=qwen3_30b_a3b_2x8", *long)))
    assert "expert-parallel peers'); runs packed\n" in replayed
    assert "needs CP≥8 on 80 GB devices" in replayed and "CP needs" not in replayed
