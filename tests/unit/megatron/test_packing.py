"""Sequence packing's layout (`megarl.megatron.packing`) and the packed attention's mask, against the padded path's
left alignment: the same tokens at the same positions, and the same logits read back for every response token;
each CP rank's chunks; token budgets; micro-batch counts agreed between expert-parallel peers."""

import pytest
import torch
import torch.nn.functional as F
from cases.megatron_cases import sample_batch

from megarl.megatron.inputs import _stretch
from megarl.megatron.micro_batches import split_by_token_budget
from megarl.megatron.packing import align_left, pack, packed_length, packed_routing, unpacked_routing
from megarl.models.context_parallel import local_positions
from megarl.models.packed_attention import causal_by_length, token_rows


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


def test_each_cp_rank_holds_chunk_i_and_its_mirror_of_every_sequence() -> None:
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # sequences of 8 and 4 tokens: chunks of 2 and 1 at CP=2
    assert local_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert local_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match=r"multiple of 2·CP = 4 tokens, got \[8, 6\]"):
        local_positions(torch.tensor([0, 8, 14], dtype=torch.int32), 2, 0)


def test_a_packed_token_budget_counts_real_tokens_and_a_padded_one_rows_times_the_longest() -> None:
    lengths = [10, 2, 2, 2, 2]
    assert split_by_token_budget(lengths, 19) == [[0], [1, 2, 3, 4]]  # padded: 2 × 10 > 19
    assert split_by_token_budget(lengths, 19, packed=True) == [[0, 1, 2, 3, 4]]  # 18 real tokens
    assert split_by_token_budget(lengths, 12, packed=True) == [[0, 1], [2, 3, 4]]


def test_a_rank_with_fewer_micro_batches_than_its_peers_splits_its_largest_then_runs_fillers() -> None:
    assert _stretch([[0, 1, 2], [3]], 3, [5, 5, 5, 1]) == [[3], [0], [1, 2]]
    assert _stretch([[0]], 3, [5]) == [[0], [], []]


@pytest.mark.parametrize("lengths", [[3, 40, 2, 5, 1, 17], [20, 24, 31, 18]], ids=["long-tail", "alike"])
def test_packed_causal_attention_by_length_groups_equals_each_sequence_alone(lengths: list[int]) -> None:
    """Long-tailed lengths run in groups of similar length (alike ones in one batch): each token's output is its
    own sequence's causal attention either way."""
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query, key, value = (torch.randn(total, 4, 8, generator=g) for _ in range(3))
    key, value = key[:, :2], value[:, :2]  # grouped-query attention: 2 KV heads for 4 query heads
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    expected = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        expected.append(attend(q, k, v)[0].transpose(0, 1).reshape(end - start, -1))
    out = causal_by_length(query, key, value, cu, attend)
    assert torch.allclose(out, torch.cat(expected), atol=1e-6)


def test_routing_goes_into_the_pack_at_each_tokens_position_and_back() -> None:
    batch = sample_batch(vocab_size=250, num_rows=4)
    mask = batch["attention_mask"]
    packed = pack(batch["input_ids"], mask, batch["responses"].shape[1], multiple=4)
    routed = torch.randint(0, 8, (*mask.shape, 2, 2), dtype=torch.int16).masked_fill(~mask.bool()[..., None, None], -1)
    in_pack = packed_routing(routed, packed.token_index, packed.ids.shape[1])
    real = packed.token_index >= 0
    assert torch.equal(packed.ids[0, packed.token_index[real]], batch["input_ids"][real])  # the tokens' places
    assert int((in_pack[:, 0, 0] >= 0).sum()) == int(mask.sum())  # the pack's padding has no record
    assert torch.equal(unpacked_routing(in_pack, packed.token_index), routed)
