"""Core attention of megatron's local (torch) layer spec that takes packed sequences.

megatron-core's `DotProductAttention` refuses `PackedSeqParams` (dot_product_attention.py `forward`: packed
input is TransformerEngine's). With THD input (`qkv_format="thd"`) the attention module hands core attention
`[t, heads, dim]` tensors, every sequence of the pack one after the other (attention.py `Attention.forward`
squeezes the batch dimension of one). `PackedDotProductAttention` attends over the pack with torch's
`scaled_dot_product_attention` and a block-diagonal causal mask built from the cumulative sequence lengths: a
token sees the tokens up to it in its own sequence and nothing of another. The padded lengths
(`cu_seqlens_q_padded`) make the blocks when given (each sequence rounded up for sequence parallelism); a
sequence's padding sits after its tokens, so causality keeps it out of them. Unpacked input goes to megatron's
own attention unchanged.

The mask and scores are `[heads, t, t]`: this is the local spec's, for CPU tests; on GPU the TransformerEngine
spec takes THD itself.
"""

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


def block_causal_mask(cu_seqlens: Tensor, total: int) -> Tensor:
    """`[t, t]` True where query i may see key j: j ≤ i, both in the same sequence of the pack."""
    positions = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)  # [t] index of each
    same = sequence.unsqueeze(0) == sequence.unsqueeze(1)
    return same & (positions.unsqueeze(0) <= positions.unsqueeze(1))


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Megatron's attention; with THD `packed_seq_params`, over the pack's sequences (module docstring)."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        self._check_packable(packed_seq_params)
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        allowed = block_causal_mask(cu_seqlens, query.shape[0])
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [heads, t, dim]
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, allowed, dropout_p=dropout, scale=scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(query.shape[0], -1)  # [t, heads · dim]

    def _check_packable(self, params: PackedSeqParams) -> None:
        if params.qkv_format != "thd":
            raise ValueError(f"packed attention takes qkv_format='thd', not {params.qkv_format!r}")
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            raise ValueError("packed local attention has no sliding window or softmax offset: use the TE spec")
