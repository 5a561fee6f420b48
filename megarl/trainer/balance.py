"""Split a step's trajectories over DP ranks so each rank gets as many rows and about as many tokens."""

from collections.abc import Sequence


def balanced_partition(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Row indices in `num_parts` parts of equal size with balanced token sums (each part sorted).

    Greedy: rows longest first, each to the lightest part that still has room.
    """
    if num_parts < 1 or len(lengths) % num_parts:
        raise ValueError(f"cannot split {len(lengths)} rows into {num_parts} parts of equal size")
    size = len(lengths) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    sums = [0] * num_parts
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        part = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: sums[p])
        parts[part].append(row)
        sums[part] += lengths[row]
    return [sorted(p) for p in parts]


def dp_order(lengths: Sequence[int], num_parts: int) -> list[int]:
    """A permutation of the rows whose `num_parts` consecutive equal chunks are the balanced parts."""
    return [row for part in balanced_partition(lengths, num_parts) for row in part]


def imbalance(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """Largest part's token sum over the mean part's."""
    sums = [sum(lengths[i] for i in part) for part in parts]
    return max(sums) / max(sum(sums) / len(sums), 1e-9)
