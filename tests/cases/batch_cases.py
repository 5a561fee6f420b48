"""`Batch` fixtures shared by tests/unit/test_batch.py and tests/unit/test_batch_padding_io.py."""

import torch

from megarl.batch import Batch


def make(n: int = 4, **meta: object) -> Batch:
    """Row i: x = [2i, 2i+1], y = i, ids = [0..i], name = "ri"."""
    return Batch.from_dict(
        tensors={"x": torch.arange(n * 2).view(n, 2), "y": torch.arange(n, dtype=torch.float32)},
        non_tensors={"ids": [list(range(i + 1)) for i in range(n)], "name": [f"r{i}" for i in range(n)]},
        meta=dict(meta),
    )


def names(batch: Batch) -> list[str]:
    return list(batch["name"])


def assert_same(a: Batch, b: Batch) -> None:
    assert len(a) == len(b) and a.keys() == b.keys() and a.meta == b.meta
    for key in a.tensor_keys:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for key in a.non_tensor_keys:
        assert a[key].dtype == object and list(a[key]) == list(b[key]), key
