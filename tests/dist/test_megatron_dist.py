"""Real megatron-core over gloo on 4 local processes: parity with transformers and across layouts."""

from pathlib import Path

import pytest
import safetensors.torch
import torch
from cases.megatron_cases import (
    hf_token_stats,
    layout,
    rank_calls,
    rank_log_probs,
    rank_offload_round_trip,
    rank_ppo_updates,
    rank_random_init,
    rank_uneven_shares,
    sample_batch,
    save_random_model,
    with_training_columns,
)

from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import MegatronConfig, OptimConfig
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn

WORLD = 4
SP_PP = {"tp": 2, "pp": 2, "sequence_parallel": True}
CP_LAYOUTS = {"cp2": {"cp": 2}, "cp2tp2": {"cp": 2, "tp": 2, "sequence_parallel": True}}
"""Context parallelism: packed only (each sequence's 2·CP chunks over the CP ranks)."""
DENSE_LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "tp2pp2": {"tp": 2, "pp": 2}}
MOE_LAYOUTS = {"tp1": {}, "ep2": {"ep": 2}, "ep2tp2": {"ep": 2, "tp": 2}}
PP_EP_LAYOUT = {"pp2ep2": {"pp": 2, "ep": 2}}
"""PP with EP: megatron's alltoall dispatcher (its allgather one refuses PP's variable sequence lengths)."""
MIXED_MOE_LAYOUTS = {**MOE_LAYOUTS, "tp2": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2}}
"""Dense and MoE layers in one model: pipeline stages build different layer mixes."""
ARCHS = {  # context parallelism on one family per attention and rope variant; every layout on one family of each
    # kind, the others at their fullest layout (CI time: the paths are shared, the families differ in their layers)
    "qwen2": {**DENSE_LAYOUTS, **CP_LAYOUTS},
    "llama": {"tp2pp2": DENSE_LAYOUTS["tp2pp2"]},
    "qwen3": {"tp2pp2": DENSE_LAYOUTS["tp2pp2"]},
    "qwen3_moe": {**MOE_LAYOUTS, **PP_EP_LAYOUT, **CP_LAYOUTS},
    "mixtral": {"ep2tp2": MOE_LAYOUTS["ep2tp2"]},
    "qwen2_moe": MIXED_MOE_LAYOUTS,
    "glm4_moe": {**MIXED_MOE_LAYOUTS, **CP_LAYOUTS},  # partial rotary
    "deepseek_v3": {**MIXED_MOE_LAYOUTS, **PP_EP_LAYOUT, **CP_LAYOUTS},  # multi-latent attention, YaRN
    "moonlight": {"tp2": MIXED_MOE_LAYOUTS["tp2"]},  # the full q_proj split over TP; plain rope
}


def test_log_probs_match_transformers_for_every_architecture_and_layout(tmp_path: Path) -> None:
    """Log-probs, entropy and Σπ² (the optimal token baseline's input), vocab-parallel under TP; padded and packed
    (THD through `PackedDotProductAttention`: with its mask not causal, log-probs differ by ~1.8), and packed only
    under context parallelism (with each rank's two chunks in reversed order, log-probs differ by ~1.2)."""
    batch = sample_batch(vocab_size=250)  # 250 pads to 256 at TP2: padding rows must not leak
    refs, cases = {}, []
    for arch, layouts in ARCHS.items():
        model_dir = save_random_model(arch, tmp_path / arch, num_layers=4, tie=arch == "qwen2")
        refs[arch] = hf_token_stats(model_dir, batch)
        cases += [(f"{arch}/{name}", model_dir, layout(WORLD, **sizes)) for name, sizes in layouts.items()]
    extras = ("entropy", "sum_pi_squared")
    batching = MicroBatching(micro_batch_size=4)
    uneven = MicroBatching(use_dynamic_bsz=True, max_token_len=1)  # a micro-batch per row
    calls = [
        (rank_log_probs, (cases, batch, batching, torch.float32, extras, True)),
        (rank_uneven_shares, (tmp_path / "qwen3_moe", layout(WORLD, ep=2), batch, uneven)),
    ]
    results, shares = zip(*spawn(rank_calls, WORLD, calls), strict=True)
    # expert-parallel peers (ranks 0-1, 2-3) with 1 and 2, 3 and 4 rows run as many micro-batches: rank 0 one filler
    assert [count for count, _ in shares] == [2, 2, 4, 4]
    for dp_rank, (_, share) in enumerate(shares):
        diff = (share["log_probs"] - refs["qwen3_moe"]["log_probs"][: dp_rank + 1]).abs().max().item()
        assert diff <= 1e-4, f"qwen3_moe/ep2, rows 0..{dp_rank} by the token budget: max |Δ log p| = {diff}"
    padded = {name for name, _, case_layout in cases if case_layout.cp == 1}
    assert set(results[0]) == padded | {f"{name}+packed" for name, _, _ in cases}
    for name, _, _ in cases:
        ref = refs[name.split("/")[0]]
        assert ref["log_probs"].abs().max() > 1.0  # non-trivial logits
        for rank_result in results:
            for key in ("log_probs", *extras):
                diff = (rank_result[f"{name}+packed"][key] - ref[key]).abs().max().item()
                assert diff <= 1e-4, f"{name}+packed: max |Δ {key}| = {diff}"
                if name not in padded:  # context parallel: against the family's TP1 padded result
                    tp1 = rank_result[f"{name.split('/')[0]}/tp1"][key]
                    cp = (rank_result[f"{name}+packed"][key] - tp1).abs().max().item()
                    assert cp <= 1e-5, f"{name}+packed: against tp1 padded, max |Δ {key}| = {cp}"
                    continue
                diff = (rank_result[name][key] - ref[key]).abs().max().item()
                assert diff <= 1e-4, f"{name}: max |Δ {key}| = {diff}"
                packed = (rank_result[f"{name}+packed"][key] - rank_result[name][key]).abs().max().item()
                assert packed <= 1e-5, f"{name}: packed against padded, max |Δ {key}| = {packed}"


def test_deepseek_v3_log_probs_match_transformers_at_pp3_with_uneven_stages(tmp_path: Path) -> None:
    """Uneven pipeline stages (megatron's first/last stage layer counts), as DeepSeek-V3's 61 layers need: five
    layers (three stages cannot split them evenly) as 2 (dense layer 0 and a MoE layer), 1 and 2 over three stages."""
    batch = sample_batch(vocab_size=250)
    model_dir = save_random_model("deepseek_v3", tmp_path / "deepseek_v3", num_layers=5)
    ref = hf_token_stats(model_dir, batch)["log_probs"]
    uneven = layout(3, pp=3, num_layers_in_first_stage=2, num_layers_in_last_stage=2)
    cases = [("pp3_uneven", model_dir, uneven)]
    for rank, result in enumerate(spawn(rank_log_probs, 3, cases, batch, MicroBatching(micro_batch_size=4))):
        diff = (result["pp3_uneven"]["log_probs"] - ref).abs().max().item()
        assert diff <= 1e-4, f"deepseek_v3 at PP3 with 2/1/2 layers, rank {rank}: max |Δ log p| = {diff}"


def test_random_init_is_the_same_under_every_layout(tmp_path: Path) -> None:
    sizes = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
    cases = []
    for arch in ("qwen2", "qwen3"):  # tied with q/k/v biases; untied with q_norm/k_norm
        model_dir = save_random_model(arch, tmp_path / arch, num_layers=4, tie=arch == "qwen2")
        for name, (tp, pp) in sizes.items():
            megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            cases.append((f"{arch}/{name}", model_dir, megatron))
    results = spawn(rank_random_init, WORLD, cases, 7)
    for arch in ("qwen2", "qwen3"):
        merged: dict[str, dict[str, torch.Tensor]] = {name: {} for name in sizes}
        for rank_result in results:
            for name in sizes:
                merged[name].update(rank_result[f"{arch}/{name}"])
        tp1 = merged["tp1"]
        for name, weights in merged.items():
            assert weights.keys() == tp1.keys(), name
            unequal = [k for k in tp1 if not torch.equal(weights[k], tp1[k])]
            assert not unequal, f"{arch}/{name} differs from tp1 in {unequal}"
        for key, tensor in tp1.items():
            if key.endswith("norm.weight"):
                assert torch.equal(tensor, torch.ones_like(tensor)), key
            elif key.endswith(".bias"):
                assert torch.equal(tensor, torch.zeros_like(tensor)), key
            else:
                assert 0.015 < tensor.std().item() < 0.025, key
        layer0, layer2 = (tp1[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 2))
        assert not torch.equal(layer0, layer2)  # each tensor has its own stream


@pytest.fixture(scope="module")
def ppo_updates(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    """Per case: the merged HF tensors, rank 0's metrics, each rank's offload bytes; the initial HF tensors; and
    each rank's bf16 offload round trip (`rank_offload_round_trip`), run in the same spawn. The `moe_*` cases train
    Qwen3-MoE, the `aux_*` cases Qwen3-MoE with a load-balancing loss."""
    root = tmp_path_factory.mktemp("ppo")
    model_dir = save_random_model("qwen2", root / "qwen2", num_layers=4)
    # moe_*: no aux loss, which is megatron's, per micro-batch, so it changes with the DP split
    moe_dir = save_random_model("qwen3_moe", root / "qwen3_moe", num_layers=4, router_aux_loss_coef=0.0)
    aux_dir = save_random_model("qwen3_moe", root / "qwen3_moe_aux", num_layers=4, router_aux_loss_coef=0.5)
    batch = with_training_columns(sample_batch(vocab_size=250, num_rows=8))
    cases = [
        ("tp1", layout(WORLD), MicroBatching(micro_batch_size=1), False, False),
        ("tp2pp2", layout(WORLD, tp=2, pp=2), MicroBatching(micro_batch_size=3), False, False),
        ("dynamic", layout(WORLD), MicroBatching(use_dynamic_bsz=True, max_token_len=20), True, False),
        (
            "packed_tp2pp2",
            layout(WORLD, tp=2, pp=2, sequence_parallel=True),
            MicroBatching(micro_batch_size=3),
            False,
            True,
        ),
        (
            "packed_cp2tp2",
            layout(WORLD, cp=2, tp=2, sequence_parallel=True),
            MicroBatching(micro_batch_size=3),
            False,
            True,
        ),
    ]
    algo = AlgorithmConfig(entropy_coeff=0.01)
    sgd = OptimConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_grad=100.0)  # SGD: no Adam noise amplification
    adam = OptimConfig(name="adam", lr=1e-2, weight_decay=0.0, clip_grad=100.0)
    moe_cases = [
        (f"moe_{name}", layout(WORLD, **sizes), MicroBatching(micro_batch_size=3), False, False)
        for name, sizes in (("tp1", {}), ("pp2ep2", {"pp": 2, "ep": 2}))
    ]
    aux_cases = [
        (f"aux_{name}", layout(WORLD), MicroBatching(micro_batch_size=3), False, name == "packed")
        for name in ("padded", "packed")
    ]
    aux_cases += [  # one row per micro-batch: the same micro-batches under every DP size
        (f"aux_row_{name}", layout(WORLD, **sizes), MicroBatching(micro_batch_size=1), False, False)
        for name, sizes in (("tp1", {}), ("tp2", {"tp": 2, "sequence_parallel": True}), ("pp2tp2", SP_PP))
    ]
    calls = [
        (rank_ppo_updates, (model_dir, cases, batch, algo, sgd, False)),
        (rank_ppo_updates, (moe_dir, moe_cases, batch, algo, sgd, False)),
        (rank_ppo_updates, (aux_dir, aux_cases, batch, algo, sgd, False)),
        (rank_offload_round_trip, (model_dir, layout(WORLD), batch, algo, adam, torch.bfloat16)),
    ]
    dense, moe, aux, round_trips = zip(*spawn(rank_calls, WORLD, calls), strict=True)
    merged: dict = {}
    for results in (dense, moe, aux):
        for name in results[0]:
            weights: dict[str, torch.Tensor] = {}
            for rank_result in results:
                weights.update(rank_result[name][0])
            merged[name] = (weights, results[0][name][1], [r[name][2] for r in results])
    return merged, safetensors.torch.load_file(str(model_dir / "model.safetensors")), list(round_trips)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_ppo_update_is_the_same_under_tp1_and_tp2_pp2_padded_or_packed(ppo_updates: tuple) -> None:
    runs, initial, _ = ppo_updates
    assert set(runs["tp1"][0]) == set(initial)
    assert _max_diff(runs["tp1"][0], initial) > 1e-2  # the step moved the weights
    assert _max_diff(runs["tp2pp2"][0], runs["tp1"][0]) <= 1e-5
    tp1 = runs["tp1"][1]
    for case in ("tp2pp2", "packed_tp2pp2", "packed_cp2tp2"):  # packed: THD, each row rounded up to TP (·2CP)
        assert _max_diff(runs[case][0], runs["tp1"][0]) <= 1e-5, case
        for key in ("loss", "pg_loss", "entropy", "grad_norm"):
            assert runs[case][1][key] == pytest.approx(tp1[key], rel=1e-5), (case, key)
    assert tp1["lr"] == 0.5


def test_moe_ppo_update_is_the_same_under_tp1_and_pp2_ep2(ppo_updates: tuple) -> None:
    """PP with EP: megatron's alltoall dispatcher, its uneven all-to-all over gloo, forward and backward."""
    runs, _, _ = ppo_updates
    tp1, pp2ep2 = runs["moe_tp1"], runs["moe_pp2ep2"]
    assert _max_diff(pp2ep2[0], tp1[0]) <= 1e-5
    assert tp1[1]["grad_norm"] > 0
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert pp2ep2[1][key] == pytest.approx(tp1[1][key], rel=1e-5), key


def test_the_moe_load_balancing_loss_leaves_padding_out(ppo_updates: tuple) -> None:
    """With `router_aux_loss_coef` 0.5, the same micro-batches of 3 rows padded (left-aligned, up to the longest) and
    packed give the same update: the routers count real tokens only (`padding_mask`), as megatron's aux loss would
    count the padded ones otherwise."""
    runs, _, _ = ppo_updates
    padded, packed = runs["aux_padded"], runs["aux_packed"]
    assert _max_diff(padded[0], packed[0]) <= 1e-5
    assert padded[1]["grad_norm"] == pytest.approx(packed[1]["grad_norm"], rel=1e-5)
    # TP2 with sequence parallelism (rows rounded up to 2 tokens) splits the mask like the sequence, on the first
    # stage (megatron splits it) and on the second (megarl hands it its part)
    for case in ("aux_row_tp2", "aux_row_pp2tp2"):
        assert _max_diff(runs[case][0], runs["aux_row_tp1"][0]) <= 1e-5, case


def test_token_budget_micro_batches_give_the_same_update(ppo_updates: tuple) -> None:
    runs, _, _ = ppo_updates
    assert _max_diff(runs["dynamic"][0], runs["tp1"][0]) <= 1e-5
    assert runs["dynamic"][1]["grad_norm"] == pytest.approx(runs["tp1"][1]["grad_norm"], rel=1e-5)


def test_offload_frees_every_byte_and_reload_restores_them(ppo_updates: tuple) -> None:
    runs, _, _ = ppo_updates
    for before, during, after in runs["dynamic"][2]:
        assert before > 0
        assert during == 0
        assert after == before


def test_bf16_offload_takes_the_master_weights_and_no_gradient_copy_and_training_goes_on_bit_identical(
    ppo_updates: tuple,
) -> None:
    """bf16 parameters, the distributed optimizer over DP=4, Adam: an offload also frees the fp32 master weights
    (megatron keeps them in `shard_fp32_from_float16_groups`, outside `optimizer.state`), frees the gradient
    buffers without a host copy, and the step after the reload (its gradient buffers holding NaN) is the step
    without an offload, bit for bit."""
    _, _, round_trips = ppo_updates
    for result in round_trips:
        memory = result["memory"]
        before = memory["before"]
        assert memory["master_before"] > 0 and memory["master_during"] == 0
        # the masters and Adam's two fp32 moments of them (and of the shards of parameters kept in fp32)
        assert before["optimizer"] >= 3 * memory["master_before"]
        assert memory["during"] == {"params": 0, "grads": 0, "optimizer": 0}
        assert memory["freed"] == sum(before.values()) and before["grads"] > 0
        assert memory["host"] == before["params"] + before["optimizer"]  # no copy of the gradient buffers
        (straight, straight_metrics), (offloaded, offloaded_metrics) = result["straight"], result["offloaded"]
        assert offloaded_metrics == straight_metrics and straight_metrics[1]["grad_norm"] > 0
        assert straight.keys() == offloaded.keys()
        assert all(torch.equal(straight[key], offloaded[key]) for key in straight)
