"""A vision-language trajectory's images on the agent side: what the engine is sent and what the trainer reads.

A trajectory starts with its prompt's images (the dataset's `images` and `multi_modal_inputs` columns) and gains
those a tool returns (`ToolResult.images`). Its token ids hold one image token per merged patch, as the trainer
computes log-probs on them; an engine request carries one placeholder per image instead and the images as
`image_data` (base64), which the engine expands (SGLang's multimodal processor; `sglang_api.collapse_image_tokens`).
"""

import base64
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.images import ImageInputs


@dataclass(slots=True)
class TrajectoryImages:
    """One trajectory's images so far, in token order."""

    encoded: list[str]
    """Base64 of each image, what `/generate` receives as `image_data`."""
    inputs: dict[str, torch.Tensor] | None
    """`{"pixel_values", "image_grid_thw"}` of all of them (the trainer's `multi_modal_inputs` row), None without."""

    def add(self, more: ImageInputs, images: list[Any]) -> None:
        """Append `images` (as `to_base64` takes them), whose patches are `more`."""
        self.encoded += [to_base64(image) for image in images]
        if self.inputs is None:
            self.inputs = {"pixel_values": more.pixel_values, "image_grid_thw": more.grid_thw}
            return
        self.inputs = {
            "pixel_values": torch.cat([self.inputs["pixel_values"], more.pixel_values]),
            "image_grid_thw": torch.cat([self.inputs["image_grid_thw"], more.grid_thw]),
        }


def to_base64(image: Any) -> str:
    """An image as `image_data` takes it: encoded bytes (or a `{"bytes"}` dict) as base64; text as it is."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return base64.b64encode(bytes(image)).decode()
    if isinstance(image, str):
        return image
    raise TypeError(f"an image must be encoded bytes or text, got {type(image).__name__}")
