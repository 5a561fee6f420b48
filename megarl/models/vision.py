"""Vision-language models: what megarl reads of their vision tower, its weight names and M-RoPE positions.

Supported: Qwen2.5-VL (`qwen2_5_vl`). The language model is the family's text model (Qwen2) and goes through the
bridge as before; the vision tower (windowed ViT with 2-D rotary and a patch merger) is transformers' own module,
built from the checkpoint's `vision_config` on the first pipeline stage (`megarl.megatron.vision`). Its
parameters keep their HF names under `vision.` (HF `visual.`) and are replicated on every rank.

M-RoPE: each token has a (temporal, height, width) position. Text tokens have three equal positions counting on
from the previous token; an image's tokens (one per merged patch, row-major over its `h/m × w/m` grid) have
temporal = start, height = start + row, width = start + column, and text after the image resumes at
start + max(h, w)/m (transformers modeling_qwen2_5_vl.py `Qwen2_5_VLModel.get_rope_index` and
`get_vision_position_ids`).
"""

import json
from dataclasses import dataclass
from typing import Any

import torch

from megarl.models.param_mapping import ParamMapping

VISION_FAMILIES = {"qwen2_5_vl": "qwen2"}
"""Vision-language `model_type` → the model_type of its language model."""


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
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """The tower's parameters: (HF name under `visual.`, shape), in module order."""

    def vision_config(self) -> Any:
        from transformers import AutoConfig

        config = json.loads(self.config_json)
        return AutoConfig.for_model(config.pop("model_type"), **config)


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
    config_json = hf_config.vision_config.to_json_string(use_diff=False)
    spec = VisionSpec(
        family=hf_config.model_type,
        config_json=config_json,
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
        spatial_merge_size=hf_config.vision_config.spatial_merge_size,
        mrope_section=tuple(int(n) for n in rope["mrope_section"]),
        params=(),
    )
    with torch.device("meta"):
        tower = build_vision_tower(spec)
    params = tuple((name, tuple(p.shape)) for name, p in tower.named_parameters())
    return VisionSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "params": params})


def text_config(hf_config: Any) -> Any:
    """The config the bridge reads for the language model: a VLM's `text_config` named as its text family, with
    the VLM's embedding tying; any other config as it is."""
    if hf_config.model_type not in VISION_FAMILIES:
        return hf_config
    text = hf_config.text_config.__class__.from_dict(hf_config.text_config.to_dict())
    text.model_type = VISION_FAMILIES[hf_config.model_type]
    text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
    return text


def vision_mappings(vision: VisionSpec) -> list[ParamMapping]:
    """The tower's parameters: megatron `vision.<name>` = HF `visual.<name>`, replicated."""
    return [ParamMapping(f"vision.{name}", (f"visual.{name}",), hf_shapes=(shape,)) for name, shape in vision.params]


def mrope_positions(ids: torch.Tensor, grids: torch.Tensor, vision: VisionSpec) -> torch.Tensor:
    """`[3, n]` M-RoPE positions of one row's real tokens `ids` `[n]` whose images have `grids` `[images, 3]`
    (module docstring). Raises ValueError when the image tokens and the grids disagree."""
    is_image = ids == vision.image_token_id
    starts = (is_image & ~torch.cat([is_image.new_zeros(1), is_image[:-1]])).nonzero().flatten().tolist()
    if len(starts) != len(grids):
        raise ValueError(f"a row has {len(starts)} image token run(s) but {len(grids)} image grid(s)")
    parts, cursor, position = [], 0, 0
    for start, grid in zip(starts, grids.tolist(), strict=True):
        text = start - cursor
        parts.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        block = _image_positions(grid, vision.spatial_merge_size) + position
        parts.append(block)
        cursor = start + block.shape[1]
        if not bool(is_image[start:cursor].all()) or (cursor < len(ids) and bool(is_image[cursor])):
            raise ValueError(f"an image of grid {grid} needs {block.shape[1]} consecutive image tokens")
        position += max(grid[1], grid[2]) // vision.spatial_merge_size
    parts.append(torch.arange(position, position + len(ids) - cursor).expand(3, -1))
    return torch.cat(parts, dim=1)


def _image_positions(grid: list[int], merge: int) -> torch.Tensor:
    """`[3, t·h·w/merge²]` (temporal, height, width) offsets of an image's tokens, row-major."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(axes).reshape(3, -1)
