"""A vision-language model's first pipeline stage: image embeddings in the decoder input, M-RoPE positions.

Rows carry their images as `multi_modal_inputs` (one `{"pixel_values", "image_grid_thw"}` dict per row, None for a
row without images; `megarl.data.images`). The vision tower (`chunk.vision`, transformers' module, replicated on
every TP rank) embeds a micro-batch's images; their embeddings replace the word embeddings at the image tokens,
in row order then position order, as transformers' `masked_scatter` does (modeling_qwen2_5_vl.py
`Qwen2_5_VLModel.forward`). Under sequence parallelism the full-length image embeddings are split like the
sequence (`scatter_to_sequence_parallel_region`), whose backward all-gathers: every TP rank's tower receives the
whole gradient, so a trainable tower stays identical across TP without a reduction of its own.
"""

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
from torch import Tensor

from megarl.batch import MULTI_MODAL_COLUMN
from megarl.models.vision import VisionSpec, build_vision_tower, mrope_positions

MULTI_MODAL = MULTI_MODAL_COLUMN


@dataclass(frozen=True, slots=True)
class VisionTraining:
    """Which parts of the vision tower train (`ModelConfig.freeze_vision_tower`, `train_projector`)."""

    tower: bool = False
    projector: bool = False


FROZEN_TOWER = VisionTraining()


def attach_vision_tower(
    chunk: torch.nn.Module, vision: VisionSpec, dtype: torch.dtype, training: VisionTraining
) -> None:
    """Give a first-stage chunk its vision tower as `chunk.vision`, trainable as `training` says (the projector
    is transformers' `merger`)."""
    tower = build_vision_tower(vision).to(dtype)
    tower.requires_grad_(training.tower)
    if training.projector:
        tower.merger.requires_grad_(True)
    chunk.vision = tower


def row_images(rows: list[Any]) -> tuple[Tensor, Tensor] | None:
    """The rows' images as one (pixel_values `[patches, ·]`, grid_thw `[images, 3]`), or None without any."""
    present = [row for row in rows if row is not None and len(row["image_grid_thw"])]
    if not present:
        return None
    return torch.cat([row["pixel_values"] for row in present]), torch.cat([row["image_grid_thw"] for row in present])


def image_embeddings(tower: torch.nn.Module, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
    """`[image tokens, h]`: the tower's merged patch embeddings, images one after another."""
    param = next(tower.parameters())
    out = tower(pixel_values.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    return out.pooler_output if hasattr(out, "pooler_output") else out


def decoder_input(chunk: Any, ids: Tensor, rows: list[Any], vision: VisionSpec, sp_group: Any) -> Tensor:
    """`[s (/TP under SP), b, h]`: the word embeddings of `ids` `[b, s]` with the rows' image embeddings at their
    image tokens; `sp_group`: the TP group under sequence parallelism, else None."""
    words = chunk.embedding(input_ids=ids, position_ids=None)
    images = row_images(rows)
    mask = ids == vision.image_token_id  # [b, s]
    found = int(mask.sum())
    if images is None:
        if found:
            raise ValueError(f"a micro-batch has {found} image token(s) but no images in `{MULTI_MODAL}`")
        return words
    embeds = image_embeddings(chunk.vision, *images)
    if embeds.shape[0] != found:
        raise ValueError(f"a micro-batch's images give {embeds.shape[0]} embeddings for {found} image tokens")
    full = words.new_zeros(*ids.shape, words.shape[-1]).index_put((mask,), embeds.to(words.dtype))
    full, mask = full.transpose(0, 1).contiguous(), mask.transpose(0, 1)
    if sp_group is not None:
        full = scatter_to_sequence_parallel_region(full, group=sp_group)
        mask = mask.chunk(sp_group.size(), dim=0)[sp_group.rank()]
    return torch.where(mask.unsqueeze(-1), full, words)


def row_positions(ids: Tensor, mask: Tensor, rows: list[Any], vision: VisionSpec) -> Tensor:
    """`[3, b, s]` M-RoPE positions of the rows' real tokens in the batch's own layout (0 on padding)."""
    out = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
    empty = torch.zeros(0, 3, dtype=torch.long)
    for i, row in enumerate(rows):
        real = mask[i].bool()
        grids = row["image_grid_thw"] if row is not None else empty
        out[:, i, real] = mrope_positions(ids[i, real].cpu(), grids, vision).to(ids.device)
    return out


def aligned_positions(micro: dict[str, Any], vision: VisionSpec, source: Tensor) -> Tensor:
    """`[3, b, L]` M-RoPE positions of left-aligned rows (`megarl.megatron.packing.left_alignment`'s `source`)."""
    positions = row_positions(micro["input_ids"], micro["attention_mask"], micro[MULTI_MODAL], vision)
    return positions.gather(2, source.unsqueeze(0).expand(3, -1, -1))


def packed_positions(micro: dict[str, Any], vision: VisionSpec, token_index: Tensor, total: int) -> Tensor:
    """`[3, 1, t]` M-RoPE positions of packed rows (`megarl.megatron.packing.Pack.token_index`); 0 on padding."""
    mask = micro["attention_mask"].bool()
    positions = row_positions(micro["input_ids"], mask, micro[MULTI_MODAL], vision)
    out = positions.new_zeros(3, 1, total)
    out[:, 0, token_index[mask]] = positions[:, mask]
    return out
