"""megarl-plan on a vision-language model: the image tokens an image takes against hand computations from the image
processor's config, and the vision tower's activations, kept only when it trains."""

import pytest
from conftest import compose_config

from megarl.assets import asset_path
from megarl.cli.plan import main as plan_main
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.memory import role_memory
from megarl.plan.params import count_params
from megarl.plan.vision import image_budget, tower_activation_bytes

LENGTHS = ["data.max_prompt_length=300", "data.max_response_length=100"]


def test_image_tokens_come_from_the_image_processor(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's tokenizer_vl processor: max_pixels 50176 (224²), 14-pixel patches merged 2×2, so
    224² / 28² = 64 tokens; a 300-token prompt holds 4 such images, a 60-token one none."""
    budget = image_budget(compose_config("model=tiny_qwen2_5_vl", *LENGTHS))
    assert budget is not None and (budget.max_pixels, budget.tokens_per_image, budget.prompt_images) == (50176, 64, 4)
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["model=tiny_qwen2_5_vl", *LENGTHS])
    assert not exit_info.value.code
    assert "images: up to 64 tokens each (max_pixels 50176" in capsys.readouterr().out
    short = image_budget(compose_config("model=tiny_qwen2_5_vl", "data.max_prompt_length=60"))
    assert short is not None and short.prompt_images == 0
    assert image_budget(compose_config("+experiment=qwen2_5_vl_7b_tp4")) is None, "a config-only directory"


@pytest.mark.parametrize(
    ("model", "per_patch"),
    [
        # Qwen2.5-VL tiny tower: hidden 32, 2 blocks, gated MLP 64 wide; one merger.
        ("tiny_qwen2_5_vl", {"projector": 4 * 32, "tower": 4 * 32 + 2 * (8 * 32 + 3 * 64)}),
        # Qwen3-VL tiny tower: the same sizes, a plain MLP, the merger and 2 deepstack mergers.
        ("tiny_qwen3_vl", {"projector": 3 * 4 * 32, "tower": 3 * 4 * 32 + 2 * (8 * 32 + 2 * 64)}),
    ],
)
def test_the_tower_keeps_activations_only_when_it_trains(model: str, per_patch: dict[str, int]) -> None:
    """A 1,000-token micro-batch of rows 300 + 100 long holds at most 750 image tokens, 4 patches each (2×2 merge),
    fp32. The actor's activations grow by exactly the tower's."""
    trains = {
        "frozen": [],
        "projector": ["model.train_projector=true"],
        "tower": ["model.freeze_vision_tower=false"],
    }
    spec = model_spec(load_hf_config(asset_path(f"models/{model}")))
    actor = {}
    for name, overrides in trains.items():
        cfg = compose_config(f"model={model}", *LENGTHS, *overrides)
        tower = tower_activation_bytes(cfg, spec, 1000, act_bytes=4)
        assert tower == pytest.approx(750 * 4 * per_patch.get(name, 0) * 4), name
        actor[name] = role_memory("actor", cfg, spec, count_params(spec), cfg.actor.megatron, 1, tokens=1000)
    for name in ("projector", "tower"):
        grown = actor[name].activations - actor["frozen"].activations
        assert grown == pytest.approx(750 * 4 * per_patch[name] * 4), name
