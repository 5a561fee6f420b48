"""What a vision-language model adds to the plan: the image tokens an image may take, and the vision tower's
activations kept for backward.

Image tokens. Qwen2.5-VL's and Qwen3-VL's image processors resize an image to at most `max_pixels` (transformers 5:
`size.longest_edge` of `preprocessor_config.json`; older files: `max_pixels`), then cut it into patch × patch
squares, `merge_size`² of which make one image token (transformers image_processing_qwen2_vl.py `smart_resize`).
Image tokens count in `data.max_prompt_length`, and the dataset drops a row that does not fit, so a prompt holds
at most `max_prompt_length // tokens_per_image` images of the largest size.

Activations. The tower runs on the first pipeline stage of every TP and CP rank, on all the micro-batch's images
(`megarl.megatron.vision`). A frozen tower builds no autograd graph (no parameter needs a gradient and pixels
need none), so it keeps nothing; a trained projector keeps its mergers' inputs and intermediates; a trained tower
also keeps each block's as a layer does (`megarl.plan.memory`: norms, Q, K, V and the attention output, the MLP's
intermediates: 3 for a gated MLP, 2 otherwise). The fullest micro-batch is one of full-length rows whose prompts are
all image tokens, so its image tokens are its tokens × max_prompt / (max_prompt + max_response).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from megarl.config.root import MegarlConfig
from megarl.models.spec import ModelSpec

PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True, slots=True)
class ImageBudget:
    """The largest image the image processor makes, in image tokens, and how many fit a prompt."""

    source: str
    """The `preprocessor_config.json` read."""
    max_pixels: int
    tokens_per_image: int
    prompt_images: int
    """Images of `tokens_per_image` that `data.max_prompt_length` holds (0: not even one)."""


def image_budget(cfg: MegarlConfig) -> ImageBudget | None:
    """The budget from the image processor of `model.tokenizer_path`, else `model.path`; None where neither has one
    (e.g. a config-only directory, as megarl's `qwen*_vl_*` assets)."""
    for directory in (cfg.model.tokenizer_path, cfg.model.path):
        path = Path(directory or "") / PROCESSOR_FILE
        if directory and path.is_file():
            processor = json.loads(path.read_text())
            max_pixels = int(processor.get("size", {}).get("longest_edge") or processor["max_pixels"])
            pixels_per_token = (processor["patch_size"] * processor["merge_size"]) ** 2
            tokens = max(1, max_pixels // pixels_per_token)
            return ImageBudget(str(path), max_pixels, tokens, cfg.data.max_prompt_length // tokens)
    return None


def tower_activation_bytes(cfg: MegarlConfig, spec: ModelSpec, tokens: int, act_bytes: int) -> float:
    """Bytes the vision tower keeps for backward in one micro-batch of `tokens` tokens (module docstring); 0 for a
    text model or a frozen tower."""
    vision = spec.vision
    if vision is None or (cfg.model.freeze_vision_tower and not cfg.model.train_projector):
        return 0.0
    d = cfg.data
    patches = (
        tokens * d.max_prompt_length / (d.max_prompt_length + d.max_response_length) * vision.spatial_merge_size**2
    )
    config = vision.vision_config()
    hidden = config.hidden_size
    per_patch = 4 * hidden * (1 + vision.deepstack_layers)  # the merger(s): norm in/out, the hidden layer in/out
    if not cfg.model.freeze_vision_tower:
        gated = any(name.endswith("mlp.gate_proj.weight") for name, _ in vision.params)
        per_patch += config.depth * (8 * hidden + (3 if gated else 2) * config.intermediate_size)
    return patches * per_patch * act_bytes


def image_lines(cfg: MegarlConfig, budget: ImageBudget | None) -> list[str]:
    """The report's lines on image tokens."""
    if budget is None:
        where = cfg.model.tokenizer_path or cfg.model.path
        return [f"           images: no {PROCESSOR_FILE} in {where}, so the image tokens per image are unknown"]
    fits = f"holds {budget.prompt_images}" if budget.prompt_images else "holds none: rows with one are dropped"
    return [
        f"           images: up to {budget.tokens_per_image} tokens each (max_pixels {budget.max_pixels}, "
        f"{budget.source}); data.max_prompt_length={cfg.data.max_prompt_length} {fits}"
    ]
