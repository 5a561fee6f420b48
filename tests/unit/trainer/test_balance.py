"""DP balancing: equal row counts per rank, token sums close to even."""

import random

import pytest

from megarl.trainer.balance import balanced_partition, dp_order, imbalance


def test_parts_have_equal_sizes_and_form_a_permutation() -> None:
    lengths = [random.Random(0).randint(1, 500) for _ in range(64)]
    parts = balanced_partition(lengths, 4)
    assert [len(p) for p in parts] == [16] * 4
    assert sorted(dp_order(lengths, 4)) == list(range(64))
    assert all(p == sorted(p) for p in parts)


def test_balanced_beats_contiguous_chunks_on_sorted_lengths() -> None:
    lengths = list(range(1, 65)) * 2  # contiguous chunks of a sorted batch are badly skewed
    lengths.sort()
    contiguous = [list(range(i, i + 32)) for i in range(0, 128, 32)]
    balanced = balanced_partition(lengths, 4)
    assert imbalance(lengths, contiguous) > 1.5
    assert imbalance(lengths, balanced) < 1.01


@pytest.mark.parametrize("seed", range(5))
def test_random_lengths_balance_within_ten_percent(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 1000) for _ in range(64)]
    assert imbalance(lengths, balanced_partition(lengths, 4)) <= 1.1


def test_indivisible_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 10 rows into 4 parts"):
        balanced_partition([1] * 10, 4)
