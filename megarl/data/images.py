"""Images as a vision-language model takes them: decoded, turned into patches, and counted in tokens.

The model's own image processor (transformers' `AutoImageProcessor` of the model or tokenizer directory: for
Qwen2.5-VL / Qwen3-VL `Qwen2VLImageProcessor`) resizes each image to a multiple of `patch_size · merge_size`
and flattens it into patches `pixel_values` `[patches, C·T·P·P]` with one `[t, h, w]` grid per image
(`image_grid_thw`, in patches). The prompt holds one `<|image_pad|>` per image; the model reads one per merged
patch, `t·h·w / merge²`, which `expand_image_tokens` inserts — what the model's processor does in its `__call__`
(transformers processing_qwen2_5_vl.py `Qwen2_5_VLProcessor.__call__`). megarl does it on the token ids itself:
that processor also needs a video processor (torchvision), which the CPU stack lacks.
"""

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError


class ImageError(ValueError):
    """An image that cannot be decoded or does not match its prompt's placeholders."""


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """One prompt's images as the vision tower takes them."""

    pixel_values: torch.Tensor
    """`[patches, C·T·P·P]` float32, the images' patches one image after another."""
    grid_thw: torch.Tensor
    """`[images, 3]` int64: each image's temporal, height and width extent in patches."""

    def token_counts(self, merge_size: int) -> list[int]:
        """Image tokens per image: its patches over the `merge_size`² the patch merger folds into one."""
        return (self.grid_thw.prod(dim=-1) // merge_size**2).tolist()


def decode_image(data: Any) -> Image.Image:
    """An RGB image from encoded bytes, a `{"bytes": ...}` dict (datasets' Image feature), base64 text (bare or a
    `data:image/...;base64,` URL) or a file path. Raises `ImageError` naming what it got."""
    if isinstance(data, Image.Image):
        return data.convert("RGB")
    if isinstance(data, dict):
        data = data.get("bytes") or data.get("path")
    if isinstance(data, str):
        data = _text_image(data)
    if not isinstance(data, (bytes, bytearray)):
        raise ImageError(f"an image must be encoded bytes, base64 text or a path, got {type(data).__name__}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ImageError(f"cannot decode an image of {len(data)} bytes ({err}); store PNG or JPEG bytes") from err


def _text_image(text: str) -> bytes:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    elif len(text) < 4096 and _is_file(text):
        return Path(text).read_bytes()
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"image text is neither a file nor base64 ({text[:40]!r}…)") from err


def _is_file(text: str) -> bool:
    """Whether `text` names a file. Base64 text is none, also when a stretch of it between `/`s is longer than a file
    name may be (NAME_MAX): pathlib's `is_file` raises ENAMETOOLONG for that instead of answering False."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def image_inputs(images: list[Any], image_processor: Any) -> ImageInputs:
    """Patches and grids of `images` (anything `decode_image` takes) by the model's image processor."""
    decoded = [decode_image(image) for image in images]
    out = image_processor(images=decoded, return_tensors="pt")
    return ImageInputs(pixel_values=out["pixel_values"].float(), grid_thw=out["image_grid_thw"].long())


def expand_image_tokens(ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """`ids` with the i-th `image_token_id` repeated `counts[i]` times. Raises `ImageError` when the prompt's
    placeholders and its images differ in number."""
    found = ids.count(image_token_id)
    if found != len(counts):
        raise ImageError(
            f"the prompt has {found} image placeholder(s) but {len(counts)} image(s); put one image part "
            '({"type": "image"}) in the messages per image in the row\'s images column'
        )
    return repeat_at_images(ids, ids, counts, image_token_id)


def repeat_at_images(values: list[int], ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """`values` (one per token of `ids`) with the value at the i-th `image_token_id` of `ids` repeated `counts[i]`
    times: `ids` themselves expanded, or a per-token column (a loss mask) laid out like them."""
    expanded: list[int] = []
    images = iter(counts)
    for token, value in zip(ids, values, strict=True):
        expanded += [value] * next(images) if token == image_token_id else [value]
    return expanded


IMAGE_TOKEN = "<|image_pad|>"
"""Qwen2.5-VL's image placeholder token."""


class ImageProcessor:
    """A vision-language model's image processor (from its tokenizer directory) and image token: turns a prompt's
    or a tool's images into patches and expands their placeholders."""

    def __init__(self, path: str, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(self.processor, "merge_size", 2))

    @classmethod
    def of(cls, tokenizer: Any, path: str) -> "ImageProcessor | None":
        """The processor of a vision-language tokenizer directory (it knows the image token and holds
        `preprocessor_config.json`); None for a text tokenizer."""
        token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        known = token_id is not None and token_id != tokenizer.unk_token_id
        if not (known and (Path(path) / "preprocessor_config.json").is_file()):
            return None
        return cls(path, token_id)

    def inputs(self, images: list[Any]) -> ImageInputs:
        return image_inputs(images, self.processor)

    def token_counts(self, images: list[Any]) -> list[int]:
        """Image tokens per image, as `inputs(images).token_counts` gives them, from the decoded sizes alone: the
        processor's own `get_number_of_image_patches` (its resize rule) without resizing or cutting patches."""
        sizes = [decode_image(image).size for image in images]
        merged = self.merge_size**2
        return [self.processor.get_number_of_image_patches(h, w, {}) // merged for w, h in sizes]

    def expand(self, ids: list[int], inputs: ImageInputs) -> list[int]:
        """`ids` with one placeholder per image of `inputs` expanded to one token per merged patch."""
        return expand_image_tokens(ids, inputs.token_counts(self.merge_size), self.image_token_id)
