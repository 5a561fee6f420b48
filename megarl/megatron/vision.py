"""A vision-language model's first pipeline stage: image embeddings in the decoder input, M-RoPE positions.

Rows carry their images as `multi_modal_inputs` (one `{"pixel_values", "image_grid_thw"}` dict per row, None for a
row without images; `megarl.data.images`). The vision tower (`chunk.vision`, transformers' module, replicated on
every TP rank) embeds a micro-batch's images; their embeddings replace the word embeddings at the image tokens,
in row order then position order, as transformers' `masked_scatter` does (modeling_qwen2_5_vl.py
`Qwen2_5_VLModel.forward`). Under sequence parallelism the full-length image embeddings are split like the
sequence (`scatter_to_sequence_parallel_region`), whose backward all-gathers: every TP rank's tower receives the
whole gradient, so a trainable tower stays identical across TP without a reduction of its own.

Qwen3-VL's deepstack features (`megarl.models.vision`) are laid out the same way (zeros off the image tokens) and
added to the outputs of decoder layers 0 .. n-1 by forward hooks on those layers (`Deepstack`); the layers must be
on the first pipeline stage. megarl never recomputes activations, so each hook runs once per micro-batch, right
after `decoder_input` set that micro-batch's features; the last one lets them go.
"""

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
from torch import Tensor

from megarl.batch import MULTI_MODAL_COLUMN
from megarl.models.vision import VisionSpec, build_vision_tower, mrope_positions


@dataclass(frozen=True, slots=True)
class VisionTraining:
    """Which parts of the vision tower train (`ModelConfig.freeze_vision_tower`, `train_projector`)."""

    tower: bool = False
    projector: bool = False


FROZEN_TOWER = VisionTraining()


def attach_vision_tower(chunk: Any, vision: VisionSpec, dtype: torch.dtype, training: VisionTraining) -> None:
    """Give a first-stage chunk its vision tower as `chunk.vision`, trainable as `training` says (the projector
    is transformers' `merger`, with Qwen3-VL's `deepstack_merger_list`), and its deepstack hooks."""
    tower = build_vision_tower(vision).to(dtype)
    tower.requires_grad_(training.tower)
    if training.projector:
        tower.merger.requires_grad_(True)
        getattr(tower, "deepstack_merger_list", torch.nn.Module()).requires_grad_(True)
    chunk.vision = tower
    chunk.deepstack = Deepstack(chunk, vision.deepstack_layers)


class Deepstack:
    """The deepstack features of the micro-batch in flight, added after decoder layers 0 .. n-1 of a first-stage
    chunk by forward hooks (module docstring)."""

    def __init__(self, chunk: Any, layers: int) -> None:
        self.features: list[Tensor] = []
        held = {layer.layer_number - 1: layer for layer in chunk.decoder.layers}
        missing = sorted(set(range(layers)) - set(held))
        if missing:
            raise ValueError(
                f"deepstack adds image features after decoder layers 0..{layers - 1}, but layer(s) {missing} are not "
                "on the first pipeline stage; give it more layers (fewer pipeline stages)"
            )
        for i in range(layers):
            held[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def add(module: torch.nn.Module, args: Any, output: tuple[Tensor, Any]) -> tuple[Tensor, Any] | None:
            if not self.features:
                return None
            hidden = output[0] + self.features[i].to(output[0].dtype)
            if i == len(self.features) - 1:  # the last use: free them now, not when the next micro-batch starts
                self.features = []
            return hidden, *output[1:]

        return add


def row_images(rows: list[Any]) -> tuple[Tensor, Tensor] | None:
    """The rows' images as one (pixel_values `[patches, ·]`, grid_thw `[images, 3]`), or None without any."""
    present = [row for row in rows if row is not None and len(row["image_grid_thw"])]
    if not present:
        return None
    return torch.cat([row["pixel_values"] for row in present]), torch.cat([row["image_grid_thw"] for row in present])


def image_embeddings(tower: torch.nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The tower's merged patch embeddings `[image tokens, h]`, images one after another, and its deepstack
    features (each the same shape; none for a tower without deepstack)."""
    param = next(tower.parameters())
    out = tower(pixel_values.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    if not hasattr(out, "pooler_output"):
        return out, []
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def decoder_input(
    chunk: Any, ids: Tensor, mask: Tensor, rows: list[Any], sp_group: Any, local: Tensor | None = None
) -> Tensor:
    """`[s (/TP under SP), b, h]`: the word embeddings of `ids` `[b, s]` with the rows' image embeddings at their
    image tokens `mask` `[b, s]` (`image_tokens`); `sp_group`: the TP group under sequence parallelism, else None;
    `local`: under context parallelism, the positions of the pack `ids` `[1, t]` this rank holds. Sets the chunk's
    deepstack features for this micro-batch."""
    words = chunk.embedding(input_ids=ids if local is None else ids[:, local], position_ids=None)
    chunk.deepstack.features = []
    images = row_images(rows)
    found = int(mask.sum())
    if images is None:
        if found:
            raise ValueError(f"a micro-batch has {found} image token(s) but no images in `{MULTI_MODAL_COLUMN}`")
        return words
    embeds, deepstack = image_embeddings(chunk.vision, *images)
    if embeds.shape[0] != found:
        raise ValueError(f"a micro-batch's images give {embeds.shape[0]} embeddings for {found} image tokens")
    place = _Placement(mask, local, sp_group)
    chunk.deepstack.features = [place.spread(feature, words) for feature in deepstack]
    return torch.where(place.mask.unsqueeze(-1), place.spread(embeds, words), words)


class _Placement:
    """Where a micro-batch's image tokens sit in this rank's decoder input `[s (/CP, /TP), b, h]`."""

    def __init__(self, mask: Tensor, local: Tensor | None, sp_group: Any) -> None:
        self.full, self.local, self.sp_group = mask, local, sp_group
        mine = (mask if local is None else mask[:, local]).transpose(0, 1)
        self.mask = mine if sp_group is None else mine.chunk(sp_group.size(), dim=0)[sp_group.rank()]
        """`[s (/CP, /TP), b]`: this rank's image tokens."""

    def spread(self, rows: Tensor, words: Tensor) -> Tensor:
        """`rows` `[image tokens, h]` at this rank's image tokens, zeros elsewhere (SP: split as the sequence, whose
        backward all-gathers the gradient)."""
        full = words.new_zeros(*self.full.shape, words.shape[-1]).index_put((self.full,), rows.to(words.dtype))
        mine = (full if self.local is None else full[:, self.local]).transpose(0, 1).contiguous()
        return mine if self.sp_group is None else scatter_to_sequence_parallel_region(mine, group=self.sp_group)


def image_tokens(micro: dict[str, Any], vision: VisionSpec) -> Tensor:
    """`[b, s]` the rows' image tokens: the image token id wherever the model did not sample it. A sampled one
    (under `response_mask`) is text, as the engine took it: a word embedding at a text position."""
    ids, response = micro["input_ids"], micro["response_mask"]
    sampled = torch.zeros_like(ids, dtype=torch.bool)
    sampled[:, ids.shape[1] - response.shape[1] :] = response.bool()
    return (ids == vision.image_token_id) & ~sampled


def row_positions(micro: dict[str, Any], vision: VisionSpec, is_image: Tensor) -> Tensor:
    """`[3, b, s]` M-RoPE positions of the rows' real tokens in the batch's own layout (0 on padding), with their
    image tokens `is_image` (`image_tokens`)."""
    ids = micro["input_ids"]
    out = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
    empty = torch.zeros(0, 3, dtype=torch.long)
    for i, row in enumerate(micro[MULTI_MODAL_COLUMN]):
        real = micro["attention_mask"][i].bool()
        grids = row["image_grid_thw"] if row is not None else empty
        positions = mrope_positions(is_image[i, real].cpu(), grids, vision.spatial_merge_size)
        out[:, i, real] = positions.to(ids.device)
    return out


def aligned_layout(micro: dict[str, Any], vision: VisionSpec, source: Tensor) -> None:
    """Set `position_ids` `[3, b, L]` (M-RoPE) and `image_mask` `[b, L]` of left-aligned rows
    (`megarl.megatron.packing.left_alignment`'s `source`; the alignment's padding is never an image token)."""
    is_image = image_tokens(micro, vision)
    positions = row_positions(micro, vision, is_image)
    micro["position_ids"] = positions.gather(2, source.unsqueeze(0).expand(3, -1, -1))
    aligned = is_image.gather(1, source)
    micro["image_mask"] = aligned & (micro["aligned_ids"] == vision.image_token_id)


def packed_layout(micro: dict[str, Any], vision: VisionSpec, token_index: Tensor, total: int) -> None:
    """Set `position_ids` `[3, 1, t]` (M-RoPE; 0 on padding) and `image_mask` `[1, t]` of packed rows
    (`megarl.megatron.packing.Pack.token_index`)."""
    real, is_image = micro["attention_mask"].bool(), image_tokens(micro, vision)
    positions = row_positions(micro, vision, is_image)
    out = positions.new_zeros(3, 1, total)
    out[:, 0, token_index[real]] = positions[:, real]
    mask = torch.zeros(1, total, dtype=torch.bool, device=real.device)
    mask[0, token_index[real]] = is_image[real]
    micro.update(position_ids=out, image_mask=mask)
