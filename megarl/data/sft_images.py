"""Images in SFT rows: a conversation's `images` column (one encoded image per `{"type": "image"}` part of its
messages, in order) as a vision-language model trains on it.

The same steps as `RLDataset` (megarl/data/dataset.py) over a whole conversation: the chat template renders each
image part as `<|vision_start|><|image_pad|><|vision_end|>`; `SFTImages.expand` expands each placeholder to one
`<|image_pad|>` per merged patch (`megarl.data.images.expand_image_tokens`), in the prompt and the response alike,
with no loss on image tokens. The expanded length is what `sft.max_length` counts, so an over-long conversation
with images is dropped (never cut: its image tokens must match its patches). A row's `multi_modal_inputs`
(`{"pixel_values", "image_grid_thw"}`, None without images) is computed when the row is read and travels with the
batch as a non-tensor column (`collate_images`) to the Megatron engine (megarl/megatron/inputs.py).
"""

from typing import Any

from megarl.batch import MULTI_MODAL_COLUMN
from megarl.data.checks import DataError
from megarl.data.dataset import IMAGES
from megarl.data.images import IMAGE_TOKEN, ImageError, ImageProcessor, expand_image_tokens, repeat_at_images


class SFTImages:
    """A vision-language tokenizer's image processor, applied to SFT conversations."""

    def __init__(self, processor: ImageProcessor) -> None:
        self.processor = processor

    @classmethod
    def of(cls, tokenizer: Any, columns: list[str], files: list[str]) -> "SFTImages | None":
        """The image side of a dataset whose rows have an `images` column; None without one; DataError when the
        tokenizer cannot read images."""
        if IMAGES not in columns:
            return None
        path = tokenizer.name_or_path
        found = ImageProcessor.of(tokenizer, path)
        if found is None:
            raise DataError(
                f"{files} have an `{IMAGES}` column but the tokenizer at {path!r} has no {IMAGE_TOKEN} token or no "
                "preprocessor_config.json; set model.tokenizer_path to the vision-language model's directory"
            )
        return cls(found)

    def fingerprint(self) -> str:
        return str(self.processor.processor.to_json_string())

    def expand(
        self, prompt_ids: list[int], response_ids: list[int], response_mask: list[int], images: list[Any]
    ) -> tuple[list[int], list[int], list[int]]:
        """Prompt, response and loss mask with each placeholder expanded (the first images are the prompt's); the
        mask is 0 on image tokens. Raises `ImageError` when placeholders and images differ in number."""
        token = self.processor.image_token_id
        counts = self.processor.token_counts(images)
        found = prompt_ids.count(token) + response_ids.count(token)
        if found != len(counts):
            raise ImageError(
                f"the conversation has {found} image placeholder(s) but {len(counts)} image(s); put one image part "
                '({"type": "image"}) in the messages per image in the row\'s images column'
            )
        num_prompt = prompt_ids.count(token)
        prompt = expand_image_tokens(prompt_ids, counts[:num_prompt], token)
        response = expand_image_tokens(response_ids, counts[num_prompt:], token)
        no_loss = [0 if t == token else m for t, m in zip(response_ids, response_mask, strict=True)]
        return prompt, response, repeat_at_images(no_loss, response_ids, counts[num_prompt:], token)

    def inputs(self, images: list[Any]) -> dict[str, Any] | None:
        """A row's `multi_modal_inputs`: its images' patches and grids; None without images."""
        if not images:
            return None
        inputs = self.processor.inputs(images)
        return {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.grid_thw}


def collate_images(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The batch's `multi_modal_inputs` column when its rows carry one (an image dataset); nothing for text."""
    if MULTI_MODAL_COLUMN not in rows[0]:
        return {}
    return {MULTI_MODAL_COLUMN: [row[MULTI_MODAL_COLUMN] for row in rows]}
