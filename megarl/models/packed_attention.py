"""Core attention of megatron's local (torch) layer spec that takes packed sequences.

megatron-core's `DotProductAttention` refuses `PackedSeqParams` (dot_product_attention.py `forward`: packed
input is TransformerEngine's). With THD input (`qkv_format="thd"`) the attention module hands core attention
`[t, heads, dim]` tensors, every sequence of the pack one after the other (attention.py `Attention.forward`
squeezes the batch dimension of one). `PackedDotProductAttention` lays the sequences out as rows of a batch
(`[b, heads, longest, dim]`, each row from column 0), runs torch's causal `scaled_dot_product_attention` on it,
and reads each token's output back into the pack: a token sees the tokens up to it in its own sequence and
nothing of another, at the cost of attention over padded rows (what the local spec computes unpacked; the
linear layers still see only the pack's tokens). The padded lengths (`cu_seqlens_q_padded`) make the rows when
given (each sequence rounded up for sequence parallelism); a sequence's padding sits after its tokens, so
causality keeps it out of them. Unpacked input goes to megatron's own attention unchanged. On GPU the
TransformerEngine spec takes THD itself.
"""

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


def token_rows(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(row [t], column [t]): the sequence each token of a pack of `total` belongs to and its place in it."""
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"the pack holds {total} tokens but its sequence lengths add up to {int(cu_seqlens[-1])}")
    positions = torch.arange(total, device=cu_seqlens.device)
    bounds = cu_seqlens.to(positions.dtype)
    row = torch.bucketize(positions, bounds[1:], right=True)
    return row, positions - bounds[row]


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
        row, column = token_rows(cu_seqlens, query.shape[0])
        shape = (len(cu_seqlens) - 1, int(column.max()) + 1)

        def as_rows(packed: Tensor) -> Tensor:  # [t, heads, dim] → [b, heads, longest, dim]
            rows = packed.new_zeros(*shape, *packed.shape[1:])
            rows[row, column] = packed
            return rows.transpose(1, 2)

        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            as_rows(query),
            as_rows(key),
            as_rows(value),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)[row, column].reshape(query.shape[0], -1)  # [t, heads · dim]

    def _check_packable(self, params: PackedSeqParams) -> None:
        if params.qkv_format != "thd":
            raise ValueError(f"packed attention takes qkv_format='thd', not {params.qkv_format!r}")
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            raise ValueError("packed local attention has no sliding window or softmax offset: use the TE spec")
