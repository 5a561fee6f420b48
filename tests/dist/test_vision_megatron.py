"""Qwen2.5-VL on real megatron-core over gloo, in one 4-process world: log-probs of prompts with 1 and 2 images
match transformers' `Qwen2_5_VLForConditionalGeneration` at TP1, TP2 with sequence parallelism and PP2, padded
and packed; one PPO step trains the vision tower alike under TP1 and TP2+SP, and leaves a frozen one untouched;
weight sync at TP2×PP2 (the tower on stage 0) into a real embedded engine started from dummy weights: after each of
two syncs its log-probs on prompts with images match the trainer's."""

from pathlib import Path

import pytest
import torch
import transformers
from cases.engine_cases import start_engine
from cases.megatron_cases import layout, rank_calls, rank_log_probs, save_asset_model
from cases.vision_cases import (
    TOKENIZER_VL,
    hf_vision_log_probs,
    random_images,
    rank_vision_sync_twice,
    rank_vision_updates,
    vision_batch,
)

from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.data.images import image_inputs
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn
from megarl.megatron.weights import SafetensorsReader

WORLD = 4
LAYOUTS = {"tp1": {}, "tp2sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2}}
SGD = OptimConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_grad=100.0)  # no Adam noise amplification
ADAM = OptimConfig(name="adam", lr=1e-2, weight_decay=0.0, clip_grad=100.0)
UPDATES = [  # (name, layout, train the tower, optimizer, distributed optimizer)
    ("frozen", "tp2sp", False, ADAM, True),
    ("tower_tp1", "tp1", True, SGD, False),
    ("tower_tp2sp", "tp2sp", True, SGD, False),
]


@pytest.fixture(scope="module")
def vision_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list]:
    """(model dir, batch, every rank's [log-probs per layout, updated weights per update case, sync gaps])."""
    root = tmp_path_factory.mktemp("vl")
    model_dir = save_asset_model("tiny_qwen2_5_vl", root / "hf")
    server, url = start_engine(model_dir, root, "--load-format", "dummy", "--tokenizer-path", str(TOKENIZER_VL))
    batch = vision_batch()
    cases = [(name, model_dir, layout(WORLD, **sizes)) for name, sizes in LAYOUTS.items()]
    updates = [(name, layout(WORLD, **LAYOUTS[where]), *rest) for name, where, *rest in UPDATES]
    algo = AlgorithmConfig(entropy_coeff=0.01)
    calls = [
        (rank_log_probs, (cases, batch, MicroBatching(micro_batch_size=2), torch.float32, (), True)),
        (rank_vision_updates, (model_dir, updates, batch, algo)),
        (rank_vision_sync_twice, (model_dir, layout(WORLD, tp=2, pp=2), url)),
    ]
    try:
        return model_dir, batch, spawn(rank_calls, WORLD, calls)
    finally:
        server.stop()


def test_log_probs_with_images_match_transformers(vision_world: tuple[Path, dict, list]) -> None:
    model_dir, batch, results = vision_world
    ref = hf_vision_log_probs(model_dir, batch)
    assert [len(r["image_grid_thw"]) if r else 0 for r in batch["multi_modal_inputs"]] == [1, 2, 0, 1]
    other = dict(batch, multi_modal_inputs=list(batch["multi_modal_inputs"]))
    picture = image_inputs(
        random_images([(56, 56)], seed=99), transformers.AutoImageProcessor.from_pretrained(TOKENIZER_VL)
    )
    other["multi_modal_inputs"][0] = {"pixel_values": picture.pixel_values, "image_grid_thw": picture.grid_thw}
    # the image reaches the model: another picture of the same size moves the row's log-probs
    assert (hf_vision_log_probs(model_dir, other)[0] - ref[0]).abs().max() > 1e-2
    for log_probs, _, _ in results:
        assert set(log_probs) == {*LAYOUTS, *(f"{name}+packed" for name in LAYOUTS)}
        for name, stats in log_probs.items():
            diff = (stats["log_probs"] - ref).abs().max().item()
            assert diff <= 1e-4, f"{name}: max |Δ log p| = {diff}"


def test_a_trainable_tower_learns_alike_under_tp_and_sp_and_a_frozen_one_stays(
    vision_world: tuple[Path, dict, list],
) -> None:
    model_dir, _, results = vision_world
    initial = SafetensorsReader(model_dir)
    visual = [name for name in initial.names() if name.startswith("visual.")]
    first_stage = [updates for _, updates, _ in results]  # no PP here: every rank holds the tower
    for updates in first_stage:
        frozen = updates["frozen"]
        assert all(torch.equal(frozen[name], initial.get(name)) for name in visual)
        assert not torch.equal(
            frozen["model.layers.0.mlp.up_proj.weight"], initial.get("model.layers.0.mlp.up_proj.weight")
        )
        moved = max((updates["tower_tp1"][name] - initial.get(name)).abs().max().item() for name in visual)
        assert moved > 1e-4, "the trainable tower did not move"
        for name in [*visual, "model.layers.0.self_attn.q_proj.weight"]:
            diff = (updates["tower_tp2sp"][name] - updates["tower_tp1"][name]).abs().max().item()
            assert diff <= 1e-5, f"{name}: TP2+SP differs from TP1 by {diff}"


def test_an_engine_matches_the_trainer_on_image_prompts_after_each_of_two_syncs(
    vision_world: tuple[Path, dict, list],
) -> None:
    gaps = vision_world[2][0][2]
    assert gaps["1"] <= 1e-4 and gaps["2"] <= 1e-4, gaps
    assert gaps["stale"] > 1e-2, "the training step did not change the policy"
