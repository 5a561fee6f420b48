"""Images in `/generate` for a vision-language model (Qwen2.5-VL), as SGLang 0.5.23 takes them.

What SGLang does (read in the sglang==0.5.23 wheel, under `sglang/srt/`):

- `image_data` (`managers/io_struct.py::GenerateReqInput`, typed `MultimodalDataInputFormat`): per image a
  URL, file name, base64 string (bare or a `data:` URL) or bytes (`utils/common.py::load_image`). For a single
  prompt a list holds its images in order; a batch takes one entry (an image, or a list of them) per prompt
  (`_normalize_image_data`). With n > 1 a single prompt becomes a batch of one (`_handle_parallel_sampling`) and a
  flat list is then read as one image per prompt, so its images must come as `[[image, ...]]`.
- `input_ids` with `image_data` hold ONE `<|image_pad|>` per image; SGLang expands it itself. The tokenizer manager
  hands the ids to the multimodal processor (`managers/tokenizer_manager.py::_tokenize_one_request`);
  `multimodal/processors/base_processor.py::BaseMultimodalProcessor.load_mm_data` decodes them to text and counts
  one image per `<|vision_start|>(<|image_pad|>)+<|vision_end|>` (the regex of `qwen_vl.py::QwenVLImageProcessor.
  __init__`); the HF processor then expands each `<|image_pad|>` of that text into t·h·w/merge² copies and refuses a
  prompt whose pads and images differ in number (`ProcessorMixin.validate_inputs` in transformers 5.23; SGLang pins
  5.19), so ids already expanded fail. `process_and_combine_mm_data` keeps the caller's ids and inserts the copies
  (`_expand_input_ids`, on by default through SGLANG_MM_AVOID_RETOKENIZE), M-RoPE positions come from the expanded
  ids (`qwen_vl.py::_process_mm_data_uncached`), and `prompt_tokens` / input log-prob positions count the expanded
  prompt.

Here the engine does the same: one placeholder per image in, `megarl.data.images.expand_image_tokens` to expand it
(400 when placeholders and images differ in number), the model's image processor for the patches. A request with
images is prefilled alone (batch.py::KVBatch.prefill), with the 3-D positions of transformers'
`Qwen2_5_VLModel.get_rope_index`, never from nor into the prefix cache (the cache is keyed by token ids, which do
not name the image); it then decodes in the shared batch at text position + its rope delta, which is what
`Qwen2_5_VLModel.compute_3d_position_ids` gives a text token after the images.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from megarl.data.images import ImageError, expand_image_tokens, image_inputs


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    """One prompt's images as the vision tower takes them."""

    pixel_values: torch.Tensor
    """[patches, C·T·P·P] float32, the images' patches one image after another."""
    grid_thw: torch.Tensor
    """[images, 3] int64: each image's extent in patches."""


def auto_model_class(model_path: str) -> Any:
    """The transformers Auto class that loads `model_path`: image-text-to-text where its config has a
    `vision_config`, else causal LM."""
    config = transformers.AutoConfig.from_pretrained(model_path)
    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


class VisionInputs:
    """Turns a prompt's `image_data` into its expanded ids and pixels, for the model served."""

    def __init__(self, model: transformers.PreTrainedModel, model_path: str, tokenizer_path: str | None) -> None:
        config = model.config
        self.image_token_id = int(config.image_token_id)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        self.processor = _image_processor([model_path, tokenizer_path])

    def prepare(self, prompt: list[int], images: list[Any]) -> tuple[list[int], VisionPrompt]:
        """`prompt` with its one `<|image_pad|>` per image expanded, and the images' pixels. ValueError when the
        images do not decode or do not match the placeholders."""
        inputs = image_inputs(images, self.processor)
        try:
            expanded = expand_image_tokens(prompt, inputs.token_counts(self.merge_size), self.image_token_id)
        except ImageError as e:  # the data loader's advice does not fit a /generate caller
            found = prompt.count(self.image_token_id)
            raise ImageError(
                f"input_ids hold {found} image placeholder(s) (id {self.image_token_id}) but image_data has "
                f"{len(images)} image(s); give one unexpanded placeholder per image, as SGLang does"
            ) from e
        return expanded, VisionPrompt(pixel_values=inputs.pixel_values, grid_thw=inputs.grid_thw)


def load_vision(model: transformers.PreTrainedModel, args: Any) -> VisionInputs | None:
    """`VisionInputs` of a vision-language model (its config has a `vision_config`), None for a text model; `args`
    gives `model_path` and `tokenizer_path` (engine.py::EngineArgs)."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    return VisionInputs(model, args.model_path, args.tokenizer_path)


def _image_processor(paths: list[str | None]) -> Any:
    """The image processor of the first directory of `paths` that has one (preprocessor_config.json)."""
    for path in paths:
        if path is not None and (Path(path) / "preprocessor_config.json").is_file():
            return transformers.AutoImageProcessor.from_pretrained(path)
    raise ValueError(
        f"a vision-language model needs an image processor (preprocessor_config.json) in the model or tokenizer "
        f"directory; none in {[p for p in paths if p]}: pass --tokenizer-path to a directory with one"
    )


def images_per_prompt(value: Any, batched: bool, num_prompts: int) -> list[list[Any]]:
    """Each prompt's images from a request's `image_data` (io_struct.py::GenerateReqInput._normalize_image_data):
    one image or a list for a single prompt, `[[...]]` too (n > 1); in a batch one entry per prompt, an image, a
    list or null. [] per prompt without images."""
    if value is None or value == []:
        return [[] for _ in range(num_prompts)]
    if not batched:
        nested = isinstance(value, list) and len(value) == 1 and isinstance(value[0], list)
        return [_as_list(value[0] if nested else value)]
    if not isinstance(value, list) or len(value) != num_prompts:
        raise ValueError("The length of image_data should be equal to the batch size.")
    return [_as_list(entry) for entry in value]


def _as_list(entry: Any) -> list[Any]:
    if entry is None:
        return []
    return list(entry) if isinstance(entry, list) else [entry]


def rope_positions(
    model: transformers.PreTrainedModel, context: list[int], vision: VisionPrompt
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, 1, len(context)] of `context` (expanded ids) and its rope delta: the position of a
    text token after the context is len(context) + delta (transformers `Qwen2_5_VLModel.get_rope_index`, which
    reads image tokens from `mm_token_type_ids`: 1 at each)."""
    ids = torch.tensor([context])
    mm_token_type_ids = (ids == model.config.image_token_id).int()
    positions, delta = model.model.get_rope_index(ids, mm_token_type_ids, image_grid_thw=vision.grid_thw)
    return positions, int(delta.reshape(-1)[0])


def vision_forward_inputs(
    model: transformers.PreTrainedModel, context: list[int], vision: VisionPrompt
) -> tuple[dict[str, Any], int]:
    """The keyword arguments of a forward of all of `context` with its images (ids, pixels, grids, 3-D positions,
    on the model's device), and the rope delta of the tokens after it (`rope_positions`)."""
    device = next(model.parameters()).device
    positions, delta = rope_positions(model, context, vision)
    inputs = {
        "input_ids": torch.tensor([context], device=device),
        "pixel_values": vision.pixel_values.to(device, model.dtype),
        "image_grid_thw": vision.grid_thw.to(device),
        "position_ids": positions.to(device),
    }
    return inputs, delta
