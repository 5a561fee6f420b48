"""Routing replay in megatron-core against transformers' own routers, on 4 gloo processes (EP2×TP2 with sequence
parallelism, and PP2), padded and packed (and CP2 packed); the reference under R3 on a dense-first model, on 2."""

from pathlib import Path

import torch
from cases.engine_cases import run, start_engine
from cases.megatron_cases import layout, sample_batch, save_asset_model, with_training_columns
from cases.routing_cases import (
    dense_first_moe,
    forced_routing,
    hf_routing,
    multi_turn_rollouts,
    perturbed_routers,
    rank_r2_updates,
    rank_r3,
    rank_reference,
    rank_replay,
)

from megarl.batch import NO_RECORD
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.megatron.launch import spawn

WORLD = 4
LAYOUTS = {"ep2tp2": {"ep": 2, "tp": 2}, "pp2": {"pp": 2}}
PACKED = {"ep2tp2+packed": {"ep": 2, "tp": 2}, "cp2+packed": {"cp": 2}}
"""Packed micro-batches: the routing laid out as the pack's tokens (under CP, each rank's chunks of it)."""
MIXED = {"ep2tp2+packed": PACKED["ep2tp2+packed"], "pp2": LAYOUTS["pp2"]}
"""R2 and R3: packed under EP2×TP2, padded under PP2."""


def test_replayed_routing_reaches_every_router_and_token_under_ep_tp_and_pp(tmp_path: Path) -> None:
    model_dir = save_asset_model("tiny_moe", tmp_path / "tiny_moe")
    batch = sample_batch(vocab_size=4096, num_rows=6, prompt_len=7, response_len=9)
    natural, natural_log_probs = hf_routing(model_dir, batch)
    forced = forced_routing(natural, batch["attention_mask"], num_experts=4)
    _, forced_log_probs = hf_routing(model_dir, batch, forced)
    assert (forced_log_probs - natural_log_probs).abs().max() > 1e-2  # the forced experts change the output
    cases = [(name, model_dir, layout(WORLD, **sizes), name in PACKED) for name, sizes in (LAYOUTS | PACKED).items()]
    results = spawn(rank_replay, WORLD, cases, batch, forced)
    real = batch["attention_mask"].bool()
    with_record = int((forced[..., 0] >= 0).sum())
    for name in LAYOUTS | PACKED:
        for rank, result in enumerate(results):
            r = result[name]
            where = f"{name} rank {rank}"
            assert torch.equal(r["recorded"][real], natural[real]), f"{where}: recorded top-k ≠ transformers'"
            assert (r["recorded"][~real] == NO_RECORD).all(), f"{where}: padding has a record"
            assert (r["log_probs"] - natural_log_probs).abs().max() <= 1e-4, where
            assert (r["own_log_probs"] - r["log_probs"]).abs().max() <= 1e-6, f"{where}: replaying its own record"
            assert r["own_mismatch"].sum() == 0, where
            diff = (r["replayed_log_probs"] - forced_log_probs).abs().max()
            assert diff <= 1e-4, f"{where}: replayed log-probs differ from transformers' forced routing by {diff}"
            assert int(r["replayed_tokens"].sum()) == with_record, f"{where}: token×layer pairs with a record"
            assert r["replayed_mismatch"].sum() > 0, f"{where}: the forced routing differs from the live one"
            has = forced >= 0
            assert torch.equal(r["replayed_used"][has], forced[has]), f"{where}: a router did not use the record"
            fallback = real.unsqueeze(-1).unsqueeze(-1) & ~has
            assert (r["replayed_used"][fallback] >= 0).all(), f"{where}: tokens without a record are routed live"


def test_r2_replays_the_old_log_prob_pass_routing_in_the_update(tmp_path: Path) -> None:
    """R2: the first step runs the weights that recorded (nothing differs), the second runs updated weights whose
    own routing drifted from the record; both replay it."""
    model_dir = save_asset_model("tiny_moe", tmp_path / "tiny_moe")
    batch = with_training_columns(sample_batch(vocab_size=4096, num_rows=8, prompt_len=7, response_len=9))
    natural, _ = hf_routing(model_dir, batch)
    cases = [(name, layout(WORLD, **sizes), name in PACKED) for name, sizes in MIXED.items()]
    optim = OptimConfig(lr=3e-2, weight_decay=0.0, clip_grad=0.0, lr_warmup_steps=0)
    results = spawn(rank_r2_updates, WORLD, model_dir, cases, batch, AlgorithmConfig(), optim)
    real = batch["attention_mask"].bool()
    for name in MIXED:
        for rank, result in enumerate(results):
            r, where = result[name], f"{name} rank {rank}"
            rows_real = real[r["rows"]]
            assert torch.equal(r["recorded"][rows_real], natural[r["rows"]][rows_real]), where
            first, second = (step["router_replay/mismatch_frac"] for step in r["steps"])
            assert first == 0.0, f"{where}: the recording weights route as recorded"
            assert second > 0.0, f"{where}: after an update the live routing drifts from the record"


def test_r3_replays_the_engine_routing_of_multi_turn_trajectories(tmp_path: Path) -> None:
    """The engine's routers carry a small perturbation, so it routes some tokens differently from the trainer. With
    R3 every router of the trainer uses the engine's experts on every token the engine forwarded (all turns, user
    turns included), and the engine-vs-trainer log-prob gap shrinks to what the perturbed routing weights leave."""
    model_dir = save_asset_model("tiny_moe", tmp_path / "trainer")
    engine_dir = perturbed_routers(model_dir, tmp_path / "engine", scale=0.02)
    server, url = start_engine(engine_dir, tmp_path, "--enable-return-routed-experts")
    try:
        rolled = run(multi_turn_rollouts(url, num_samples=4, model_dir=model_dir))
    finally:
        server.stop()
    assert int(rolled["num_turns"].min()) >= 3  # model, user, model, ... turns
    keys = ("input_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs", "routed_experts")
    batch = {key: rolled[key] for key in keys}
    engine_routing = batch["routed_experts"]
    has = engine_routing >= 0
    assert has.any(dim=2).sum() == batch["attention_mask"].sum() - len(engine_routing)  # all but each last token
    cases = [(name, layout(WORLD, **sizes), name in PACKED) for name, sizes in MIXED.items()]
    results = spawn(rank_r3, WORLD, model_dir, cases, batch)
    mask = batch["response_mask"].bool()
    for name in MIXED:
        r, where = results[0][name], name
        differs = (r["live_routing"] != engine_routing) & has
        share = differs.float().sum() / has.sum()
        assert share > 0.005, f"{where}: the perturbed engine routes {share:.3%} of token×layer pairs differently"
        assert torch.equal(r["used_routing"][has], engine_routing[has]), f"{where}: a router ignored the record"
        assert r["mismatch"].sum() > 0 and r["tokens"].sum() == has.any(dim=2).sum() * 2  # 2 MoE layers
        gap_without = (r["live_log_probs"] - batch["rollout_log_probs"])[mask].abs().mean()
        gap_with = (r["log_probs"] - batch["rollout_log_probs"])[mask].abs().mean()
        print(f"R3 {name}: routing differs on {share:.2%}; mean |Δ log p| {gap_without:.5f} → {gap_with:.5f}")
        assert gap_with < 0.5 * gap_without, f"{where}: replay leaves {gap_with} of {gap_without}"
        for other in results[1:]:
            assert torch.allclose(other[name]["log_probs"], r["log_probs"], atol=1e-5), f"{where}: ranks disagree"


def test_reference_replays_the_rollout_routing_by_moe_layer_on_a_dense_first_model(tmp_path: Path) -> None:
    """Under R3 the reference routes by the batch's `routed_experts` too, so its log-probs are transformers' under
    that routing, not its own. The column holds the MoE layers only (decoder layer 0 is dense; under PP2 stage 1's
    routers are MoE ordinals 1 and 2), and a recording pass (R2's column) returns that layout in int8 (4 experts)."""
    model_dir = dense_first_moe(tmp_path / "dense_first")
    batch = sample_batch(vocab_size=4096, num_rows=4, prompt_len=6, response_len=7)
    natural, natural_log_probs = hf_routing(model_dir, batch)
    assert natural.shape[2] == 3  # MoE layers 1..3 of 4
    forced = forced_routing(natural, batch["attention_mask"], num_experts=4)
    _, forced_log_probs = hf_routing(model_dir, batch, forced)
    assert (forced_log_probs - natural_log_probs).abs().max() > 1e-2  # the forced experts change the output
    real = batch["attention_mask"].bool()
    for rank, r in enumerate(spawn(rank_reference, 2, model_dir, batch, forced)):
        diff = (r["replayed"] - forced_log_probs).abs().max()
        assert diff <= 1e-4, f"rank {rank}: the reference's log-probs differ from the replayed routing's by {diff}"
        assert (r["live"] - natural_log_probs).abs().max() <= 1e-4, f"rank {rank}: live routing"
        assert r["recorded"].dtype == torch.int8 and r["recorded"].shape == (*real.shape, 3 * 2), rank
        assert torch.equal(r["recorded"].view(forced.shape)[real], natural[real].to(torch.int8)), rank
