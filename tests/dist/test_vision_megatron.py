"""Qwen2.5-VL and Qwen3-VL on real megatron-core over gloo, in one 4-process world: log-probs of prompts with 1 and 2
images match transformers' `Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration` at TP1, TP2 with
sequence parallelism and PP2, padded and packed, and CP2×TP2+SP packed (Qwen3-VL: interleaved M-RoPE and deepstack
features after decoder layers 0 and 1); one PPO step trains the vision tower alike under TP1 and TP2+SP, and leaves
a frozen one untouched; weight sync at TP2×PP2 (the tower on stage 0) into a real embedded engine started from dummy
weights: after each of two syncs its log-probs on prompts with images match the trainer's."""

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
LAYOUTS = {
    "tp1": {},
    "tp2sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "cp2tp2sp": {"cp": 2, "tp": 2, "sequence_parallel": True},  # CP splits packed sequences only
}
PADDED_TOO = {name for name, sizes in LAYOUTS.items() if "cp" not in sizes}
SGD = OptimConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_grad=100.0)  # no Adam noise amplification
ADAM = OptimConfig(name="adam", lr=1e-2, weight_decay=0.0, clip_grad=100.0)
UPDATES = [  # (name, layout, train the tower, optimizer, distributed optimizer)
    ("frozen", "tp2sp", False, ADAM, True),
    ("tower_tp1", "tp1", True, SGD, False),
    ("tower_tp2sp", "tp2sp", True, SGD, False),
]


MODELS = ("tiny_qwen2_5_vl", "tiny_qwen3_vl")


@pytest.fixture(scope="module")
def vision_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], dict, dict[str, list]]:
    """(model dir per model, batch, per model every rank's [log-probs per layout, updated weights per update case,
    sync gaps])."""
    root = tmp_path_factory.mktemp("vl")
    model_dirs = {name: save_asset_model(name, root / name) for name in MODELS}
    engines = [
        start_engine(path, root, "--load-format", "dummy", "--tokenizer-path", str(TOKENIZER_VL))
        for path in model_dirs.values()
    ]
    batch = vision_batch()
    cases = [
        (f"{m}/{n}", path, layout(WORLD, **sizes)) for m, path in model_dirs.items() for n, sizes in LAYOUTS.items()
    ]
    updates = [(name, layout(WORLD, **LAYOUTS[where]), *rest) for name, where, *rest in UPDATES]
    algo = AlgorithmConfig(entropy_coeff=0.01)
    calls = [(rank_log_probs, (cases, batch, MicroBatching(micro_batch_size=2), torch.float32, (), True))]
    for path, (_, url) in zip(model_dirs.values(), engines, strict=True):
        calls += [
            (rank_vision_updates, (path, updates, batch, algo)),
            (rank_vision_sync_twice, (path, layout(WORLD, tp=2, pp=2), url)),
        ]
    try:
        results = spawn(rank_calls, WORLD, calls)
    finally:
        for server, _ in engines:
            server.stop()
    per_model = {
        m: [
            ({n.split("/")[1]: v for n, v in r[0].items() if n.startswith(f"{m}/")}, *r[1 + 2 * i : 3 + 2 * i])
            for r in results
        ]
        for i, m in enumerate(MODELS)
    }
    return model_dirs, batch, per_model


@pytest.mark.parametrize("model", MODELS)
def test_log_probs_with_images_match_transformers(vision_world: tuple[dict, dict, dict], model: str) -> None:
    model_dirs, batch, per_model = vision_world
    model_dir, results = model_dirs[model], per_model[model]
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
        assert set(log_probs) == {*PADDED_TOO, *(f"{name}+packed" for name in LAYOUTS)}
        for name, stats in log_probs.items():
            diff = (stats["log_probs"] - ref).abs().max().item()
            assert diff <= 1e-4, f"{name}: max |Δ log p| = {diff}"


@pytest.mark.parametrize("model", MODELS)
def test_a_trainable_tower_learns_alike_under_tp_and_sp_and_a_frozen_one_stays(
    vision_world: tuple[dict, dict, dict], model: str
) -> None:
    model_dirs, _, per_model = vision_world
    initial = SafetensorsReader(model_dirs[model])
    visual = [name for name in initial.names() if "visual." in name]
    up, q = (
        next(n for n in initial.names() if n.endswith(f"layers.0.{w}.weight"))
        for w in ("mlp.up_proj", "self_attn.q_proj")
    )
    deepstack = [name for name in visual if "deepstack_merger_list" in name]  # Qwen3-VL's: trained via the hooks
    assert bool(deepstack) == (model == "tiny_qwen3_vl")
    first_stage = [updates for _, updates, _ in per_model[model]]  # no PP here: every rank holds the tower
    for updates in first_stage:
        frozen = updates["frozen"]
        assert all(torch.equal(frozen[name], initial.get(name)) for name in visual)
        assert not torch.equal(frozen[up], initial.get(up))
        for names in filter(None, (visual, deepstack)):
            moved = max((updates["tower_tp1"][name] - initial.get(name)).abs().max().item() for name in names)
            assert moved > 1e-4, f"the trainable tower did not move ({names[0]}, ...)"
        for name in [*visual, q]:
            diff = (updates["tower_tp2sp"][name] - updates["tower_tp1"][name]).abs().max().item()
            assert diff <= 1e-5, f"{name}: TP2+SP differs from TP1 by {diff}"


@pytest.mark.parametrize("model", MODELS)
def test_an_engine_matches_the_trainer_on_image_prompts_after_each_of_two_syncs(
    vision_world: tuple[dict, dict, dict], model: str
) -> None:
    gaps = vision_world[2][model][0][2]
    assert gaps["1"] <= 1e-4 and gaps["2"] <= 1e-4, gaps
    assert gaps["stale"] > 1e-2, "the training step did not change the policy"
