"""Vision-language models: what megarl reads of their vision tower, its weight names and M-RoPE positions.

Supported: Qwen2.5-VL (`qwen2_5_vl`) and Qwen3-VL (`qwen3_vl`). The language model is the family's text model
(Qwen2, Qwen3) and goes through the bridge as before; the vision tower (Qwen2.5-VL: windowed ViT with 2-D rotary
and a patch merger; Qwen3-VL: ViT with learned, interpolated position embeddings, 2-D rotary, a patch merger and
"deepstack" mergers) is transformers' own module, built from the checkpoint's `vision_config` on the first
pipeline stage (`megarl.megatron.vision`). Its parameters keep their HF names under `vision.` and are replicated
on every rank.

Checkpoint names: transformers 5 writes Qwen2.5-VL in the legacy layout (`visual.*`, `model.layers.*`) and Qwen3-VL
in its module layout (`model.visual.*`, `model.language_model.*`); `checkpoint_name` turns the bridge's legacy names
into the latter for a family that uses it. `lm_head.*` is the same in both.

Qwen3-VL's deepstack: the tower also returns one feature map per `vision_config.deepstack_visual_indexes` entry;
feature `i` is added to the language model's hidden states at the image tokens after decoder layer `i`
(modeling_qwen3_vl.py `Qwen3VLTextModel.forward`, `_deepstack_process`).

M-RoPE: each token has a (temporal, height, width) position. Text tokens have three equal positions counting on
from the previous token; an image's tokens (one per merged patch, row-major over its `h/m × w/m` grid) have
temporal = start, height = start + row, width = start + column, and text after the image resumes at
start + max(h, w)/m (transformers modeling_qwen2_5_vl.py `Qwen2_5_VLModel.get_rope_index` and
`get_vision_position_ids`).
"""

import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from megarl.models.param_mapping import ParamMapping


@dataclass(frozen=True, slots=True)
class VisionFamily:
    text_type: str
    """The model_type of its language model."""
    interleaved_mrope: bool
    """M-RoPE frequencies interleave the axes (Qwen3-VL) instead of taking contiguous sections (Qwen2.5-VL)."""
    nested_names: bool
    """The checkpoint names tensors `model.visual.*` / `model.language_model.*` (module docstring)."""


VISION_FAMILIES = {
    "qwen2_5_vl": VisionFamily("qwen2", interleaved_mrope=False, nested_names=False),
    "qwen3_vl": VisionFamily("qwen3", interleaved_mrope=True, nested_names=True),
}
"""Vision-language `model_type` → what megarl reads of its family."""


@dataclass(frozen=True, slots=True)
class VisionSpec:
    family: str
    """The checkpoint's model_type, e.g. `qwen2_5_vl`."""
    config_json: str
    """The HF `vision_config` as JSON (hashable; `vision_config()` rebuilds it)."""
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]
    """Rotary frequency pairs per axis (temporal, height, width); they sum to head_dim / 2."""
    deepstack_layers: int
    """Decoder layers 0 .. n-1 receive a deepstack feature map (Qwen3-VL); 0 without deepstack."""
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """The tower's parameters: (HF name under `visual.`, shape), in module order."""

    def vision_config(self) -> Any:
        from transformers import AutoConfig

        config = json.loads(self.config_json)
        return AutoConfig.for_model(config.pop("model_type"), **config)

    @property
    def family_facts(self) -> VisionFamily:
        return VISION_FAMILIES[self.family]


def build_vision_tower(vision: VisionSpec) -> torch.nn.Module:
    """transformers' vision tower of `vision.family`, randomly initialised (weights are loaded after)."""
    from transformers import AutoModel

    config = vision.vision_config()
    config._attn_implementation = "sdpa"
    return AutoModel.from_config(config, dtype=torch.float32)


def vision_spec(hf_config: Any) -> "VisionSpec | None":
    """The vision side of a vision-language config; None for a text model."""
    if hf_config.model_type not in VISION_FAMILIES:
        return None
    rope = dict(hf_config.text_config.rope_parameters or {})
    if "mrope_section" not in rope:
        raise ValueError(f"{hf_config.model_type}: text_config.rope_parameters has no mrope_section")
    vision = hf_config.vision_config
    spec = VisionSpec(
        family=hf_config.model_type,
        config_json=vision.to_json_string(use_diff=False),
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
        spatial_merge_size=vision.spatial_merge_size,
        mrope_section=tuple(int(n) for n in rope["mrope_section"]),
        deepstack_layers=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
        params=(),
    )
    with torch.device("meta"):
        tower = build_vision_tower(spec)
    return replace(spec, params=tuple((name, tuple(p.shape)) for name, p in tower.named_parameters()))


def text_config(hf_config: Any) -> Any:
    """The config the bridge reads for the language model: a VLM's `text_config` named as its text family, with
    the VLM's embedding tying; any other config as it is."""
    if hf_config.model_type not in VISION_FAMILIES:
        return hf_config
    text = hf_config.text_config.__class__.from_dict(hf_config.text_config.to_dict())
    text.model_type = VISION_FAMILIES[hf_config.model_type].text_type
    text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
    return text


def vision_mappings(vision: VisionSpec) -> list[ParamMapping]:
    """The tower's parameters: megatron `vision.<name>` = HF `visual.<name>`, replicated."""
    return [ParamMapping(f"vision.{name}", (f"visual.{name}",), hf_shapes=(shape,)) for name, shape in vision.params]


def checkpoint_name(name: str, vision: VisionSpec) -> str:
    """The checkpoint's name of the bridge's (legacy-layout) HF name `name` (module docstring)."""
    if not vision.family_facts.nested_names:
        return name
    if name.startswith("visual."):
        return f"model.{name}"
    return f"model.language_model.{name[len('model.') :]}" if name.startswith("model.") else name


def frequency_axes(mrope_section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """`[head_dim / 2]`: the axis (0 temporal, 1 height, 2 width) whose position each rotary frequency turns by.
    Contiguous: the first `mrope_section[0]` frequencies are temporal, then height, then width (megatron-core's
    `MultimodalRotaryEmbedding`). Interleaved: frequency j is height when j % 3 == 1 and j < 3·section[1], width
    when j % 3 == 2 and j < 3·section[2], else temporal (modeling_qwen3_vl.py
    `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`)."""
    if not interleaved:
        return torch.cat([torch.full((n,), axis) for axis, n in enumerate(mrope_section)])
    j = torch.arange(sum(mrope_section))
    axes = torch.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axes


def mrope_positions(is_image: torch.Tensor, grids: torch.Tensor, merge: int) -> torch.Tensor:
    """`[3, n]` M-RoPE positions of one row's real tokens, of which `is_image` `[n]` are image tokens, whose images
    have `grids` `[images, 3]` and merge `merge`² patches per token (module docstring). Raises ValueError when the
    image tokens and the grids disagree."""
    starts = (is_image & ~torch.cat([is_image.new_zeros(1), is_image[:-1]])).nonzero().flatten().tolist()
    if len(starts) != len(grids):
        raise ValueError(f"a row has {len(starts)} image token run(s) but {len(grids)} image grid(s)")
    n = len(is_image)
    parts, cursor, position = [], 0, 0
    for start, grid in zip(starts, grids.tolist(), strict=True):
        text = start - cursor
        parts.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        block = _image_positions(grid, merge) + position
        parts.append(block)
        cursor = start + block.shape[1]
        if not bool(is_image[start:cursor].all()) or (cursor < n and bool(is_image[cursor])):
            raise ValueError(f"an image of grid {grid} needs {block.shape[1]} consecutive image tokens")
        position += max(grid[1], grid[2]) // merge
    parts.append(torch.arange(position, position + n - cursor).expand(3, -1))
    return torch.cat(parts, dim=1)


def _image_positions(grid: list[int], merge: int) -> torch.Tensor:
    """`[3, t·h·w/merge²]` (temporal, height, width) offsets of an image's tokens, row-major."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(axes).reshape(3, -1)
