"""Core attention of megatron's local (torch) layer spec that takes packed sequences.

megatron-core's `DotProductAttention` refuses `PackedSeqParams` (dot_product_attention.py `forward`: packed
input is TransformerEngine's). With THD input (`qkv_format="thd"`) the attention module hands core attention
`[t, heads, dim]` tensors, every sequence of the pack one after the other (attention.py `Attention.forward`
squeezes the batch dimension of one). `PackedDotProductAttention` lays the sequences out as rows of a batch
(`[b, heads, longest, dim]`, each row from column 0; sequences of similar length together, a batch per power of
two), runs torch's causal `scaled_dot_product_attention` on it, and reads each token's output back into the
pack: a token sees the tokens up to it in its own sequence and nothing of another. The padded lengths
(`cu_seqlens_q_padded`) make the rows when given (each sequence rounded up for sequence parallelism); a
sequence's padding sits after its tokens, so causality keeps it out of them. Unpacked input goes to
megatron's own attention unchanged. On GPU the TransformerEngine spec takes THD itself.

Context parallelism (`megarl.models.context_parallel`): each rank's queries are its chunks of every sequence;
keys and values are all-gathered over the CP group into the full pack (slime's all-gather CP), and a query at
position p of its sequence sees that sequence's keys up to p (an explicit mask instead of `is_causal`).
"""

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from megarl.models.context_parallel import gather_pack, local_positions


def token_rows(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(row [t], column [t]): the sequence each token of a pack of `total` belongs to and its place in it."""
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"the pack holds {total} tokens but its sequence lengths add up to {int(cu_seqlens[-1])}")
    positions = torch.arange(total, device=cu_seqlens.device)
    bounds = cu_seqlens.to(positions.dtype)
    row = torch.bucketize(positions, bounds[1:], right=True)
    return row, positions - bounds[row]


def as_rows(packed: Tensor, row: Tensor, column: Tensor, shape: tuple[int, int]) -> Tensor:
    """`[t, heads, dim]` → `[b, heads, longest, dim]`: token k at (row[k], column[k]), zeros elsewhere."""
    rows = packed.new_zeros(*shape, *packed.shape[1:])
    rows[row, column] = packed
    return rows.transpose(1, 2)


def causal_by_length(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """Causal attention `[t, heads · dim]` over a pack's sequences by `attend` (causal attention of `[b, heads, ·,
    dim]` rows), in groups of similar length (2^(k−1) < length ≤ 2^k), each group's rows padded to its longest:
    at most ~4× Σ length², not rows × longest². One group when that would not halve the cost (each group is a
    call of its own)."""
    row, column = token_rows(cu_seqlens, query.shape[0])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    group_of = torch.log2(lengths.clamp(min=1).double()).ceil().long()  # [b]
    members = [lengths[group_of == g] for g in torch.unique(group_of).tolist()]
    if 2 * sum(len(m) * int(m.max()) ** 2 for m in members) > len(lengths) * int(lengths.max()) ** 2:
        shape = (len(lengths), int(lengths.max()))
        q, k, v = (as_rows(x, row, column, shape) for x in (query, key, value))
        return attend(q, k, v).transpose(1, 2)[row, column].reshape(query.shape[0], -1)
    outputs, order = [], []
    for group in torch.unique(group_of).tolist():
        sequences = (group_of == group).nonzero().squeeze(1)
        tokens = (group_of[row] == group).nonzero().squeeze(1)  # their tokens, in pack order
        place = (torch.searchsorted(sequences, row[tokens]), column[tokens])  # (row in the group, column)
        shape = (len(sequences), int(lengths[sequences].max()))
        q, k, v = (as_rows(x[tokens], *place, shape) for x in (query, key, value))
        outputs.append(attend(q, k, v).transpose(1, 2)[place])
        order.append(tokens)
    gathered = torch.cat(outputs)
    inverse = torch.empty_like(gathered[:, 0, 0], dtype=torch.long)
    inverse[torch.cat(order)] = torch.arange(len(inverse), device=inverse.device)
    return gathered[inverse].reshape(query.shape[0], -1)


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        """megatron's local attention; its check that context parallelism is TE's is for unpacked input."""
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, *args, **kwargs)
        self.config = config

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
        cp_group = getattr(self.pg_collection, "cp", None)
        if cp_group is not None and cp_group.size() > 1:
            return self._context_parallel(query, key, value, cu_seqlens, cp_group)
        return causal_by_length(query, key, value, cu_seqlens, partial(self._attend, mask=None))

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, group: Any) -> Tensor:
        """This rank's queries against the full pack's keys and values (module docstring)."""
        total = query.shape[0] * group.size()
        row, column = token_rows(cu_seqlens, total)
        mine = local_positions(cu_seqlens, group.size(), group.rank())
        q_row, q_column = row[mine], column[mine]  # each local query's sequence and position in it
        local_starts = cu_seqlens.long() // group.size()
        q_slot = torch.arange(len(mine), device=mine.device) - local_starts[q_row]  # its column among the local rows
        q_shape = (len(cu_seqlens) - 1, int(q_slot.max()) + 1)
        kv_shape = (len(cu_seqlens) - 1, int(column.max()) + 1)
        sees = torch.zeros(q_shape, dtype=column.dtype, device=column.device)
        sees[q_row, q_slot] = q_column  # padding slots see key 0 only (never an empty row: no NaN)
        mask = torch.arange(kv_shape[1], device=column.device) <= sees.unsqueeze(-1)  # [b, q, k]
        full_key, full_value = (gather_pack(x, cu_seqlens, group) for x in (key, value))
        out = self._attend(
            as_rows(query, q_row, q_slot, q_shape),
            as_rows(full_key, row, column, kv_shape),
            as_rows(full_value, row, column, kv_shape),
            mask=mask.unsqueeze(1),
        )
        return out.transpose(1, 2)[q_row, q_slot].reshape(query.shape[0], -1)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        """Torch's SDPA over `[b, heads, ·, dim]` rows: causal, or by `mask` `[b, 1, q, k]` (True = attend)."""
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )

    def _check_packable(self, params: PackedSeqParams) -> None:
        if params.qkv_format != "thd":
            raise ValueError(f"packed attention takes qkv_format='thd', not {params.qkv_format!r}")
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            raise ValueError("packed local attention has no sliding window or softmax offset: use the TE spec")
