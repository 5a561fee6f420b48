"""Every Batch operation, its error cases, and (de)serialisation through pickle and Ray."""

import pickle
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch

from megarl.protocol import Batch


def make(n: int = 4, **meta: object) -> Batch:
    return Batch.from_dict(
        tensors={"x": torch.arange(n * 2).view(n, 2), "y": torch.arange(n, dtype=torch.float32)},
        non_tensors={"ids": [list(range(i + 1)) for i in range(n)], "name": [f"r{i}" for i in range(n)]},
        meta=dict(meta),
    )


def rows(batch: Batch) -> list[str]:
    return list(batch["name"])


def test_construction_infers_size_and_keeps_rows_as_objects() -> None:
    b = make(3, step=1)
    assert len(b) == 3 and b.tensor_keys == ["x", "y"] and b.non_tensor_keys == ["ids", "name"]
    assert b["ids"].dtype == object and b["ids"].shape == (3,) and b["ids"][2] == [0, 1, 2]
    assert "x" in b and "ids" in b and "z" not in b and b.meta == {"step": 1}
    square = Batch.from_dict(non_tensors={"m": [[1, 2], [3, 4]]})
    assert square["m"].shape == (2,) and square["m"][0] == [1, 2]
    assert len(Batch.from_dict(batch_size=5)) == 5
    assert "size=3" in repr(b) and "x: (3, 2)" in repr(b)


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="explicit batch_size"):
        Batch.from_dict()
    with pytest.raises(ValueError, match=r"tensor 'b' has shape \(2,\); expected dim 0 = 3"):
        Batch.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="non-tensor 'n' has 2 rows; the batch has 3"):
        Batch.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"n": [1, 2]})
    with pytest.raises(ValueError, match=r"keys \['a'\] are both"):
        Batch.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"a": [1, 2]})


def test_getitem_column_and_set() -> None:
    b = make(3)
    with pytest.raises(KeyError, match="no key 'zz'"):
        b["zz"]
    b.set("z", torch.ones(3))
    b.set("w", [{"a": 1}, {"a": 2}, {"a": 3}])
    assert torch.equal(b["z"], torch.ones(3)) and b["w"][1] == {"a": 2}
    b.set("z", ["now", "an", "object"])
    assert "z" in b.non_tensor_keys and "z" not in b.tensor_keys
    with pytest.raises(ValueError, match="expected dim 0 = 3"):
        b.set("bad", torch.ones(4))
    with pytest.raises(ValueError, match="has 2 rows"):
        b.set("bad", [1, 2])


def test_pop_and_select() -> None:
    b = make(3, step=1, lr=0.1)
    picked = b.select(tensor_keys=["x"], non_tensor_keys=[], meta_keys=["step"])
    assert picked.keys() == ["x"] and picked.meta == {"step": 1} and b.keys() == ["x", "y", "ids", "name"]
    assert make(2).select().keys() == ["x", "y", "ids", "name"]
    popped = b.pop(tensor_keys=["y"], non_tensor_keys=["ids"], meta_keys=["lr"])
    assert popped.keys() == ["y", "ids"] and popped.meta == {"lr": 0.1} and len(popped) == 3
    assert b.keys() == ["x", "name"] and b.meta == {"step": 1}
    with pytest.raises(KeyError, match=r"no tensor key\(s\) \['y'\]"):
        b.pop(tensor_keys=["y"])
    with pytest.raises(KeyError, match="non-tensor"):
        b.select(non_tensor_keys=["ids"])
    with pytest.raises(KeyError, match="meta"):
        b.select(meta_keys=["lr"])


def test_union() -> None:
    a = make(3, step=1)
    extra = Batch.from_dict(tensors={"x": a["x"].clone(), "v": torch.zeros(3)}, non_tensors={"k": [1, 2, 3]})
    u = a.union(extra)
    assert u.keys() == ["x", "y", "v", "ids", "name", "k"] and u.meta == {"step": 1}
    with pytest.raises(ValueError, match="tensor key 'x' differs"):
        a.union(Batch.from_dict(tensors={"x": torch.zeros(3, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="non-tensor key 'name' differs"):
        a.union(Batch.from_dict(non_tensors={"name": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match="meta key 'step' differs"):
        a.union(Batch.from_dict(batch_size=3, meta={"step": 2}))
    with pytest.raises(ValueError, match="3 and 2 rows"):
        a.union(make(2))


def test_repeat_interleaved_and_tiled() -> None:
    b = make(2)
    inter = b.repeat(3)
    assert rows(inter) == ["r0", "r0", "r0", "r1", "r1", "r1"]
    assert inter["y"].tolist() == [0, 0, 0, 1, 1, 1] and inter["ids"][3] == [0, 1]
    tiled = b.repeat(2, interleave=False)
    assert rows(tiled) == ["r0", "r1", "r0", "r1"] and tiled["x"][:, 0].tolist() == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="times=0"):
        b.repeat(0)


def test_chunk_split_and_their_errors() -> None:
    b = make(6)
    assert [rows(c) for c in b.chunk(3)] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    with pytest.raises(ValueError, match=r"cannot chunk 6 rows into 4 .*pad_to_multiple\(4\)"):
        b.chunk(4)
    assert [len(p) for p in b.split(4)] == [4, 2]
    parts = b.split([1, 0, 5])
    assert [rows(p) for p in parts] == [["r0"], [], ["r1", "r2", "r3", "r4", "r5"]]
    with pytest.raises(ValueError, match="sum to the batch size 6"):
        b.split([2, 2])
    with pytest.raises(ValueError, match="split_size=0"):
        b.split(0)


def test_pad_chunk_concat_unpad_round_trip() -> None:
    b = make(3, step=7)
    padded = b.pad_to_multiple(8)
    assert len(padded) == 8 and padded.meta["num_padding"] == 5
    assert rows(padded) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0", "r1"]
    with pytest.raises(ValueError, match="already padded"):
        padded.pad_to_multiple(2)
    chunks = padded.chunk(4)
    for c in chunks:
        c.meta.pop("num_padding")
    joined = Batch.concat(chunks)
    joined.meta["num_padding"] = padded.meta["num_padding"]
    back = joined.unpad()
    assert rows(back) == rows(b) and torch.equal(back["x"], b["x"]) and back.meta == {"step": 7}
    assert b.pad_to_multiple(3).meta["num_padding"] == 0
    with pytest.raises(ValueError, match="not padded"):
        b.unpad()
    with pytest.raises(ValueError, match="concatenate the chunks first"):
        Batch.concat(padded.chunk(2))


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    a = make(2)
    with pytest.raises(ValueError, match=r"batch 1 has different keys from batch 0: \['ids'\]"):
        Batch.concat([a, make(2).select(non_tensor_keys=["name"])])
    wide = Batch.from_dict(
        tensors={"x": torch.zeros(2, 3, dtype=torch.long), "y": torch.zeros(2)},
        non_tensors={"ids": [1, 2], "name": ["a", "b"]},
    )
    with pytest.raises(ValueError, match=r"tensor 'x' of batch 1 has row shape \(3,\)"):
        Batch.concat([a, wide])
    with pytest.raises(ValueError, match="meta 'step' of batch 1 differs"):
        Batch.concat([make(2, step=1), make(2, step=2)])
    assert Batch.concat([make(2, step=1), make(1, step=1)]).meta == {"step": 1}


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (slice(1, 3), ["r1", "r2"]),
        ([3, 0], ["r3", "r0"]),
        (torch.tensor([2, 2]), ["r2", "r2"]),
        (np.array([1]), ["r1"]),
        (torch.tensor([True, False, False, True]), ["r0", "r3"]),
        (np.array([False, True, False, False]), ["r1"]),
    ],
)
def test_indexing(index: object, expected: list[str]) -> None:
    b = make(4, step=3)
    picked = b[index]
    assert rows(picked) == expected and picked.meta == {"step": 3}
    assert picked["y"].tolist() == [float(r[1:]) for r in expected]


def test_indexing_errors() -> None:
    b = make(4)
    with pytest.raises(TypeError, match=r"batch\[1:2\]"):
        b[1]
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        b[torch.tensor([True, False])]
    with pytest.raises(TypeError, match="1-D integers or booleans"):
        b[torch.tensor([0.5])]


def test_mini_batches() -> None:
    b = make(6)
    first = [rows(m) for m in b.iter_mini_batches(2, epochs=2, seed=3)]
    assert first == [rows(m) for m in b.iter_mini_batches(2, epochs=2, seed=3)]
    assert first != [rows(m) for m in b.iter_mini_batches(2, epochs=2, seed=4)]
    assert len(first) == 6
    for epoch in (first[:3], first[3:]):
        assert sorted(r for m in epoch for r in m) == rows(b)
    assert [rows(m) for m in b.iter_mini_batches(3, shuffle=False)] == [["r0", "r1", "r2"], ["r3", "r4", "r5"]]
    with pytest.raises(ValueError, match="6 rows does not divide into mini-batches of 4"):
        next(b.iter_mini_batches(4))


def test_to_device_and_pickle() -> None:
    b = make(3, step=1)
    moved = b.to("cpu")
    assert moved["x"].device.type == "cpu" and rows(moved) == rows(b)
    back = pickle.loads(pickle.dumps(b))
    assert torch.equal(back["x"], b["x"]) and back["ids"][2] == [0, 1, 2] and back.meta == {"step": 1}
    assert "TensorDict" not in str(b.__getstate__().keys())


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as tmp:
        ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        yield
        ray.shutdown()


@ray.remote
def _double(batch: Batch) -> tuple[int, Batch]:
    batch.set("y", batch["y"] * 2)
    return len(batch), batch


def test_ray_round_trip(local_ray: None) -> None:
    b = make(3, step=1)
    same = ray.get(ray.put(b))
    assert torch.equal(same["x"], b["x"]) and list(same["ids"]) == list(b["ids"])
    size, doubled = ray.get(_double.remote(b))
    assert size == 3 and doubled["y"].tolist() == [0.0, 2.0, 4.0] and doubled.meta == {"step": 1}
