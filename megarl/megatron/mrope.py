"""M-RoPE for a vision-language GPTModel: contiguous (Qwen2.5-VL) or interleaved (Qwen3-VL) axes, whole-pack angles.

megatron-core 0.16's `MultimodalRotaryEmbedding.forward` (models/common/embeddings/rotary_pos_embedding.py) gives
each axis a contiguous block of rotary frequencies (`mrope_section`) and, under context parallelism, cuts its output
as one sequence split in 2·CP chunks. megarl's `MRoPE` replaces it (`use_mrope`) with the same inputs (`[3, b, s]`
positions) and output (`[s, b, 1, head_dim]` angles, rotate-half layout), but:
- each frequency turns by the position of its own axis, contiguous or interleaved
  (`megarl.models.vision.frequency_axes`);
- it never cuts: under CP megarl packs, positions cover the whole pack, and megatron's THD rotary takes each
  sequence's chunks of this rank from whole-pack angles (rope_utils.py `_apply_rotary_pos_emb_thd`, "exact mapping"
  when the angles are as long as the padded pack).
"""

from typing import Any

import torch
from torch import Tensor

from megarl.models.vision import frequency_axes


class MRoPE(torch.nn.Module):
    """Multimodal rotary angles from `[3, b, s]` positions (module docstring)."""

    def __init__(self, inv_freq: Tensor, interleaved: bool, interpolation: float | None) -> None:
        super().__init__()
        self.inv_freq = inv_freq
        self.interleaved = interleaved
        self.interpolation = interpolation

    def forward(self, position_ids: Tensor, mrope_section: list[int], cp_group: Any = None) -> Tensor:
        """`[s, b, 1, head_dim]` angles; `cp_group` is accepted as megatron passes it, and not used."""
        positions = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.interpolation is not None:
            positions = positions / self.interpolation
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [3, b, s, head_dim / 2]
        axes = frequency_axes(tuple(mrope_section), self.interleaved).to(freqs.device)
        half = freqs.gather(0, axes.expand(1, *freqs.shape[1:3], -1)).squeeze(0)  # [b, s, head_dim / 2]
        return torch.cat((half, half), dim=-1).transpose(0, 1).unsqueeze(2).contiguous()


def use_mrope(chunk: Any, interleaved: bool) -> None:
    """Give a GPTModel chunk built with `position_embedding_type="mrope"` megarl's `MRoPE` (same frequencies)."""
    rotary = chunk.rotary_pos_emb
    if rotary.rotary_interleaved:
        raise ValueError("M-RoPE needs rotate-half rotary (rotary_interleaved=False)")
    chunk.rotary_pos_emb = MRoPE(rotary.inv_freq, interleaved, rotary.seq_len_interpolation_factor)
