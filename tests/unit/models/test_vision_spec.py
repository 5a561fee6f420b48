"""What megarl reads of a vision-language config, by hand: M-RoPE frequency axes (contiguous, interleaved),
checkpoint names per family, M-RoPE positions of a row with an image, the tiny Qwen3-VL's spec; an image token the
model sampled is text to the trainer; deepstack's hooks on decoder layers and the layouts they refuse."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from megarl.assets import asset_path
from megarl.batch import MULTI_MODAL_COLUMN
from megarl.megatron.vision import Deepstack, image_tokens, row_positions
from megarl.models.spec import model_spec
from megarl.models.vision import checkpoint_name, frequency_axes, mrope_positions, vision_spec
from megarl.models.weight_map import weight_plan


def test_frequency_axes_contiguous_and_interleaved() -> None:
    assert frequency_axes((4, 2, 2), interleaved=False).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert frequency_axes((4, 2, 2), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    real = frequency_axes((24, 20, 20), interleaved=True)  # Qwen3-VL-8B: head_dim 128
    assert torch.bincount(real).tolist() == [24, 20, 20] and real[57:60].tolist() == [0, 1, 2]


def test_checkpoint_names_follow_the_family_layout() -> None:
    qwen3 = vision_spec(AutoConfig.from_pretrained(asset_path("models/tiny_qwen3_vl")))
    qwen25 = vision_spec(AutoConfig.from_pretrained(asset_path("models/tiny_qwen2_5_vl")))
    assert qwen3 is not None and qwen25 is not None
    names = ["visual.merger.linear_fc1.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert [checkpoint_name(n, qwen3) for n in names] == [
        "model.visual.merger.linear_fc1.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    assert [checkpoint_name(n, qwen25) for n in names] == names


def test_the_tiny_qwen3_vl_spec_and_plan() -> None:
    spec = model_spec(AutoConfig.from_pretrained(asset_path("models/tiny_qwen3_vl")))
    assert spec.model_type == "qwen3" and spec.qk_norm and spec.vision is not None
    assert spec.vision.deepstack_layers == 2 and spec.vision.mrope_section == (4, 2, 2)
    plan = weight_plan(spec, padded_vocab_size=4608)
    assert plan["vision.deepstack_merger_list.1.norm.weight"].hf_names == (
        "model.visual.deepstack_merger_list.1.norm.weight",
    )
    assert plan["embedding.word_embeddings.weight"].hf_names == ("model.language_model.embed_tokens.weight",)


def test_mrope_positions_of_a_row_with_one_image() -> None:
    """Two text tokens, a 4×4-patch image (2×2 merged tokens) from position 2, then text from 2 + 4/2 = 4."""
    qwen3 = vision_spec(AutoConfig.from_pretrained(asset_path("models/tiny_qwen3_vl")))
    assert qwen3 is not None
    is_image = torch.tensor([0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    positions = mrope_positions(is_image, torch.tensor([[1, 4, 4]]), qwen3.spatial_merge_size)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 4],
        [0, 1, 2, 2, 3, 3, 4],
        [0, 1, 2, 3, 2, 3, 4],
    ]


def test_an_image_token_the_model_sampled_is_text() -> None:
    """The engine embeds a sampled `<|image_pad|>` as a word at a text position; so does the trainer: only the
    prompt's (and tools') image tokens take image embeddings and grid positions."""
    spec = model_spec(AutoConfig.from_pretrained(asset_path("models/tiny_qwen3_vl")))
    assert spec.vision is not None
    pad = spec.vision.image_token_id
    micro = {
        "input_ids": torch.tensor([[7, pad, pad, pad, pad, 8, pad, 9]]),  # prompt of 6, then a sampled pad
        "attention_mask": torch.ones(1, 8, dtype=torch.long),
        "response_mask": torch.tensor([[1, 1]]),
        MULTI_MODAL_COLUMN: [{"pixel_values": torch.zeros(16, 1), "image_grid_thw": torch.tensor([[1, 4, 4]])}],
    }
    is_image = image_tokens(micro, spec.vision)
    assert is_image.tolist() == [[False, True, True, True, True, False, False, False]]
    assert row_positions(micro, spec.vision, is_image)[:, 0].tolist() == [
        [0, 1, 1, 1, 1, 3, 4, 5],
        [0, 1, 1, 2, 2, 3, 4, 5],
        [0, 1, 2, 1, 2, 3, 4, 5],
    ]


class _Layer(torch.nn.Module):
    """A decoder layer as deepstack sees it: megatron's 1-based `layer_number`, output (hidden, context)."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden * 1.0, None


def _run(numbers: list[int], features: list[torch.Tensor]) -> tuple[torch.Tensor, Deepstack]:
    layers = torch.nn.ModuleList(_Layer(n) for n in numbers)
    deepstack = Deepstack(SimpleNamespace(decoder=SimpleNamespace(layers=layers)), len(features) or 2)
    deepstack.features = features
    hidden = torch.zeros(2, 1, 3)
    for layer in layers:
        hidden, _ = layer(hidden)
    return hidden, deepstack


def test_deepstack_adds_each_feature_after_its_layer_then_lets_them_go() -> None:
    hidden, deepstack = _run([1, 2, 3], [torch.full((2, 1, 3), 1.0), torch.full((2, 1, 3), 2.0)])
    assert torch.equal(hidden, torch.full((2, 1, 3), 3.0))
    assert deepstack.features == [], "held until the next micro-batch otherwise"
    hidden, _ = _run([1, 2, 3], [])  # a micro-batch without images
    assert torch.equal(hidden, torch.zeros(2, 1, 3))


def test_deepstack_refuses_layers_off_the_first_stage() -> None:
    """Under PP a first stage holding decoder layers 2 and 3 (megatron numbers them from 1) lacks 0 and 1."""
    with pytest.raises(ValueError, match=r"layer\(s\) \[0, 1\] are not on the first pipeline stage"):
        _run([3, 4], [torch.zeros(2, 1, 3)] * 2)
