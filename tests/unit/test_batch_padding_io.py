"""Batch padding, concatenation, mini-batches, devices, and (de)serialisation through pickle and Ray."""

import pickle

import pytest
import torch
from cases.batch_cases import assert_same, make, names

from megarl.batch import Batch

# padding and concatenation


def test_pad_to_multiple() -> None:
    b = make(3, step=7)
    padded = b.pad_to_multiple(8)  # fewer rows than padding: the copies wrap around
    assert len(padded) == 8 and padded.meta == {"step": 7, "num_padding": 5}
    assert names(padded) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0", "r1"]
    assert padded["y"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1] and padded["ids"][7] == [0, 1]
    assert b.meta == {"step": 7} and len(b) == 3
    exact = b.pad_to_multiple(3)
    assert exact.meta["num_padding"] == 0 and names(exact) == names(b)
    assert_same(exact.unpad(), b)
    assert Batch.from_dict(batch_size=0).pad_to_multiple(4).meta["num_padding"] == 0
    with pytest.raises(ValueError, match=r"already padded \(meta\['num_padding'\]=0\); unpad\(\) it first"):
        exact.pad_to_multiple(2)
    with pytest.raises(ValueError, match="divisor=0"):
        b.pad_to_multiple(0)
    with pytest.raises(ValueError, match="meta has no 'num_padding'"):
        b.unpad()


@pytest.mark.parametrize(("size", "num_chunks"), [(3, 8), (6, 4), (8, 4), (1, 3)])
def test_pad_chunk_concat_unpad_round_trip(size: int, num_chunks: int) -> None:
    b = make(size, step=7)
    padded = b.pad_to_multiple(num_chunks)
    chunks = padded.chunk(num_chunks)
    rows_per_chunk = len(padded) // num_chunks
    padding_per_chunk = [
        sum(row >= size for row in range(j * rows_per_chunk, (j + 1) * rows_per_chunk)) for j in range(num_chunks)
    ]
    assert [c.meta["num_padding"] for c in chunks] == padding_per_chunk  # each chunk counts its own padding rows
    joined = Batch.concat(chunks)
    assert_same(joined, padded)
    assert_same(joined.unpad(), b)


def test_padding_rows_stay_last() -> None:
    padded = make(3).pad_to_multiple(4)  # r0 r1 r2 | r0
    assert [c.meta["num_padding"] for c in padded.chunk(2)] == [0, 1]
    repeated = padded.repeat(2)  # r0 r0 r1 r1 r2 r2 | r0 r0
    assert repeated.meta["num_padding"] == 2 and names(repeated.unpad()) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert padded[[0, 3]].meta["num_padding"] == 1
    with pytest.raises(ValueError, match="puts some of the 1 padding rows before real rows; unpad"):
        padded[[3, 0]]
    with pytest.raises(ValueError, match="padding rows before real rows"):
        padded.repeat(2, interleave=False)
    with pytest.raises(ValueError, match="batch 1 has real rows after padding rows"):
        Batch.concat([padded, make(3).pad_to_multiple(4)])
    with pytest.raises(ValueError, match=r"batch 0 has no meta\['num_padding'\] but others do; unpad"):
        Batch.concat([make(4), padded])
    assert len(Batch.concat([make(4).pad_to_multiple(1), padded]).unpad()) == 7


def test_concat() -> None:
    joined = Batch.concat([make(2, step=1), make(3, step=1, lr=0.1), make(1)])
    assert len(joined) == 6 and names(joined) == ["r0", "r1", "r0", "r1", "r2", "r0"]
    assert joined["x"][:, 0].tolist() == [0, 2, 0, 2, 4, 0] and joined["ids"][4] == [0, 1, 2]
    assert joined["ids"].dtype == object and joined.meta == {"step": 1, "lr": 0.1}
    reordered = make(2).select(non_tensor_keys=["name", "ids"])
    assert Batch.concat([make(2), reordered]).non_tensor_keys == ["ids", "name"]
    assert_same(Batch.concat([make(2)]), make(2))


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])
    a = make(2)
    odd = make(2).select(non_tensor_keys=["name"])
    odd.set("z", [1, 2])
    with pytest.raises(ValueError, match=r"batch 2 has different keys from batch 0: \['ids', 'z'\]"):
        Batch.concat([a, a, odd])
    with pytest.raises(ValueError, match=r"batch 1 has different keys from batch 0: \['y'\]"):
        Batch.concat([a, make(2).select(tensor_keys=["x"])])
    wide = make(2)
    wide.set("x", torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"tensor 'x' of batch 1 has rows of shape \(3,\) torch.int64, batch 0 has \(2,\)"
    ):
        Batch.concat([a, wide])
    floats = make(2)
    floats.set("x", floats["x"].float())
    with pytest.raises(ValueError, match="tensor 'x' of batch 1 has rows of shape.*float32"):
        Batch.concat([a, floats])
    with pytest.raises(ValueError, match="concat: meta 'step' differs"):
        Batch.concat([make(2, step=1), make(2, step=2)])


# iteration, device, serialisation


def test_iter_mini_batches() -> None:
    b = make(6, step=1)
    first = [names(m) for m in b.iter_mini_batches(2, epochs=2, seed=3)]
    assert first == [names(m) for m in b.iter_mini_batches(2, epochs=2, seed=3)]
    assert first != [names(m) for m in b.iter_mini_batches(2, epochs=2, seed=4)]
    assert len(first) == 6 and all(len(m) == 2 for m in first)
    for epoch in (first[:3], first[3:]):
        assert sorted(r for m in epoch for r in m) == names(b)
    second_epoch = first[3:]
    assert second_epoch == [names(m) for m in b.iter_mini_batches(2, epochs=1, seed=4)]  # epoch e uses seed + e
    assert all(m.meta == {"step": 1} for m in b.iter_mini_batches(3))
    assert [names(m) for m in b.iter_mini_batches(3, shuffle=False)] == [["r0", "r1", "r2"], ["r3", "r4", "r5"]]
    assert list(b.iter_mini_batches(2, epochs=0)) == []
    with pytest.raises(ValueError, match="batch of 6 rows does not divide into mini-batches of 4"):
        b.iter_mini_batches(4)  # raised at the call, before iterating
    with pytest.raises(ValueError, match="mini-batches of 0"):
        b.iter_mini_batches(0)


def test_to_device() -> None:
    b = make(3, step=1)
    moved = b.to("cpu")
    assert moved is not b and moved["x"].device.type == "cpu"
    assert_same(moved, b)
    moved.set("z", torch.zeros(3))
    moved.meta["lr"] = 1
    assert "z" not in b and b.meta == {"step": 1}


def test_pickle_round_trip() -> None:
    b = make(3, step=1, scores={"a": [1, 2]})
    b.set("t", torch.arange(12).view(4, 3).t()[:, :3])  # non-contiguous view
    back = pickle.loads(pickle.dumps(b))
    assert_same(back, b)
    state = b.__getstate__()
    assert type(state["tensors"]) is dict and all(t.is_contiguous() for t in state["tensors"].values())
    assert state["batch_size"] == 3 and state["meta"] == b.meta


def test_pickle_ships_only_the_rows_of_a_view() -> None:
    big = torch.zeros(10_000, 100)
    small = Batch.from_dict(tensors={"x": big[:2]})
    assert len(pickle.dumps(small)) < 10_000
    assert len(pickle.dumps(Batch.from_dict(tensors={"x": big})[:2])) < 10_000
