"""A micro-batch's token layouts: rows left-aligned and padded to the longest (`align_left`), or packed (THD).

Packing: a micro-batch's real tokens, row after row, as one sequence of the pack's length.

Rows come as the engine's trajectories (`input_ids`/`attention_mask` `[b, s]`, prompt left-padded, response
right-padded, the response the last r columns). Row i's real tokens go to pack positions
`[start_i, start_i + len_i)`, where `start_i` is the sum of the earlier rows' lengths each rounded up to
`multiple` (sequence parallelism splits the pack over TP ranks; megatron's `cu_seqlens_q_padded`), and the pack
is `total` long (at least the rounded sum: expert-parallel peers agree on one length). Position ids restart at
every row. The padding after a row's tokens is token 0, belongs to the row and is never read back.
"""

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megarl.batch import NO_RECORD


@dataclass(frozen=True, slots=True)
class Pack:
    ids: Tensor
    """[1, t] token ids."""
    positions: Tensor
    """[1, t] position ids, from 0 in every row."""
    logit_index: Tensor
    """[b, r] the pack position whose logits predict response token j of row i (clamped into the pack)."""
    params: PackedSeqParams
    token_index: Tensor
    """[b, s] the pack position of each real token of the rows, −1 on their padding."""


def packed_length(attention_mask: Tensor, multiple: int = 1) -> int:
    """The pack's length: every row's real tokens rounded up to `multiple`, summed."""
    lengths = attention_mask.sum(dim=1)
    return int((-(-lengths // multiple) * multiple).sum())


def pack(input_ids: Tensor, attention_mask: Tensor, response_len: int, multiple: int = 1, total: int = 0) -> Pack:
    """Pack the rows (module docstring); `total`: the pack's length if longer than `packed_length`."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    padded = -(-lengths // multiple) * multiple
    starts = torch.cumsum(padded, dim=0) - padded  # [b]
    size = max(int(padded.sum()), total, 1)
    rank_in_row = torch.cumsum(mask.long(), dim=1) - 1  # [b, s] the k-th real token of its row
    target = (starts.unsqueeze(1) + rank_in_row)[mask]
    ids = torch.zeros(size, dtype=input_ids.dtype, device=input_ids.device)
    ids[target] = input_ids[mask]
    ends = starts + padded
    ends[-1] = size  # the pack's tail padding goes with the last row
    row_of = torch.bucketize(torch.arange(size, device=ids.device), ends, right=True)
    positions = torch.arange(size, device=ids.device) - starts[row_of.clamp(max=len(starts) - 1)]
    shift = mask.int().argmax(dim=1)  # [b] first real column
    first = starts + input_ids.shape[1] - response_len - 1 - shift  # [b] predicts response token 0
    logit_index = (first.unsqueeze(1) + torch.arange(response_len, device=ids.device)).clamp(0, size - 1)
    token_index = torch.full_like(input_ids, -1, dtype=torch.long)
    token_index[mask] = target
    return Pack(ids.unsqueeze(0), positions.unsqueeze(0), logit_index, _params(lengths, ends - starts), token_index)


def packed_routing(routed: Tensor, token_index: Tensor, total: int) -> Tensor:
    """Rows' routing `[b, s, layers, k]` → the pack's `[total, layers, k]` (no record on its padding)."""
    out = torch.full((total, *routed.shape[2:]), NO_RECORD, dtype=routed.dtype, device=routed.device)
    real = token_index >= 0
    out[token_index[real]] = routed[real]
    return out


def unpacked_routing(packed: Tensor, token_index: Tensor) -> Tensor:
    """Inverse of `packed_routing`: `[total, layers, k]` → `[b, s, layers, k]`, no record on the rows' padding."""
    out = torch.full((*token_index.shape, *packed.shape[1:]), NO_RECORD, dtype=packed.dtype, device=packed.device)
    real = token_index >= 0
    out[real] = packed[token_index[real]]
    return out


def _params(lengths: Tensor, padded: Tensor) -> PackedSeqParams:
    zero = torch.zeros(1, dtype=torch.int32, device=lengths.device)
    cu = torch.cat([zero, torch.cumsum(lengths, dim=0).to(torch.int32)])
    cu_padded = torch.cat([zero, torch.cumsum(padded, dim=0).to(torch.int32)])
    longest = int(padded.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def aligned_length(attention_mask: Tensor, multiple: int = 1) -> int:
    """The longest row rounded up to `multiple` (sequence parallelism needs L % TP == 0)."""
    return -(-max(int(attention_mask.sum(dim=1).max()), 1) // multiple) * multiple


def left_alignment(attention_mask: Tensor, aligned_len: int) -> tuple[Tensor, Tensor]:
    """(source [b, L], lengths [b]): aligned column c of row i is column `source[i, c]` of the batch, for
    c < `lengths[i]`; L = `aligned_len` (at least `aligned_length`)."""
    width = attention_mask.shape[1]
    mask = attention_mask.bool()
    shift = mask.int().argmax(dim=1)  # [b] first real column
    lengths = mask.sum(dim=1)
    cols = torch.arange(aligned_len, device=attention_mask.device)
    return (cols.unsqueeze(0) + shift.unsqueeze(1)).clamp(max=width - 1), lengths


def align_left(
    input_ids: Tensor, attention_mask: Tensor, response_len: int, aligned_len: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Left-align rows. Returns (ids [b, L], position ids [b, L], logit index [b, r]).

    `logit index[i, j]` is the aligned column whose logits predict response token j of row i.
    L = `aligned_len`, by default the longest row (`aligned_length`).
    """
    source, lengths = left_alignment(attention_mask, aligned_len or aligned_length(attention_mask))
    aligned_len = source.shape[1]
    cols = torch.arange(aligned_len, device=input_ids.device)
    ids = input_ids.gather(1, source).masked_fill(cols.unsqueeze(0) >= lengths.unsqueeze(1), 0)
    positions = cols.unsqueeze(0).expand_as(ids)
    first = input_ids.shape[1] - response_len - 1 - source[:, 0]  # [b] column predicting response token 0
    logit_index = (first.unsqueeze(1) + torch.arange(response_len, device=ids.device)).clamp(0, aligned_len - 1)
    return ids, positions, logit_index
