"""Sequence packing's layout (`megarl.megatron.packing`) and the packed attention's mask, against the padded path's
left alignment: the same tokens at the same positions, and the same logits read back for every response token."""

import pytest
import torch
from cases.megatron_cases import sample_batch

from megarl.megatron.packing import align_left, pack, packed_length
from megarl.models.packed_attention import token_rows


def test_a_pack_holds_each_rows_tokens_from_position_zero_and_reads_the_same_logits() -> None:
    batch = sample_batch(vocab_size=250, num_rows=5)
    mask, r = batch["attention_mask"], batch["responses"].shape[1]
    lengths = mask.sum(dim=1)
    for multiple in (1, 4):
        packed = pack(batch["input_ids"], mask, r, multiple)
        padded = -(-lengths // multiple) * multiple
        assert packed.ids.shape == (1, int(padded.sum())) == (1, packed_length(mask, multiple))
        params = packed.params
        assert params.cu_seqlens_q.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
        assert params.cu_seqlens_q_padded.tolist() == [0, *torch.cumsum(padded, 0).tolist()]
        assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == int(padded.max())
        aligned, positions, logit_index = align_left(batch["input_ids"], mask, r)
        for i, start in enumerate(params.cu_seqlens_q_padded[:-1].tolist()):
            n = int(lengths[i])
            assert torch.equal(packed.ids[0, start : start + n], aligned[i, :n])
            assert torch.equal(packed.positions[0, start : start + n], positions[i, :n])
        real = batch["response_mask"].bool()  # where the logits are read (the rest is masked out)
        starts = params.cu_seqlens_q_padded[:-1].unsqueeze(1)
        assert torch.equal((packed.logit_index - starts)[real], logit_index[real])


def test_a_longer_pack_goes_to_the_last_row_and_positions_keep_counting() -> None:
    batch = sample_batch(vocab_size=250, num_rows=3)
    mask = batch["attention_mask"]
    size = packed_length(mask) + 5
    packed = pack(batch["input_ids"], mask, batch["responses"].shape[1], total=size)
    assert packed.ids.shape == (1, size) and int(packed.params.cu_seqlens_q_padded[-1]) == size
    last = int(packed.params.cu_seqlens_q_padded[-2])
    assert packed.positions[0, last:].tolist() == list(range(size - last))


def test_each_token_of_a_pack_knows_its_row_and_column() -> None:
    row, column = token_rows(torch.tensor([0, 2, 5], dtype=torch.int32), 5)
    assert row.tolist() == [0, 0, 1, 1, 1] and column.tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="holds 6 tokens but its sequence lengths add up to 5"):
        token_rows(torch.tensor([0, 2, 5], dtype=torch.int32), 6)
