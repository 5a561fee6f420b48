"""Split a mini-batch into micro-batches: a fixed count per micro-batch or a token budget.

Both return lists of row indices into the mini-batch. Every rank of a pipeline gets the same rows
and so the same split; DP ranks may run different counts (gradients are reduced once, after all
micro-batches).
"""


def split_by_count(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` rows (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro batch size must be ≥ 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, num_rows))) for s in range(0, num_rows, micro_batch_size)]


def split_by_token_budget(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Group rows so each micro-batch's size stays within `max_tokens`: rows × longest row padded, the sum of
    the rows' lengths `packed`.

    Rows are taken longest first and each goes to the first micro-batch it fits in (first-fit
    decreasing); a row longer than the budget gets a micro-batch of its own.
    Indices inside each micro-batch are sorted, and micro-batches are ordered by first index.
    """
    if max_tokens < 1:
        raise ValueError(f"max_token_len_per_device must be ≥ 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    sizes: list[int] = []  # each bin's: the sum of its lengths `packed`, else rows × its first (longest) row's length
    for row in order:
        for index, members in enumerate(bins):
            grown = sizes[index] + lengths[row] if packed else (len(members) + 1) * lengths[members[0]]
            if grown <= max_tokens:
                members.append(row)
                sizes[index] = grown
                break
        else:
            bins.append([row])
            sizes.append(lengths[row])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
