"""Every Batch operation on columns and rows, and its error cases (padding, concatenation and
(de)serialisation: tests/unit/test_batch_padding_io.py)."""

from typing import Any

import numpy as np
import pytest
import torch
from cases.batch_cases import assert_same, make, names
from tensordict import TensorDict

from megarl.batch import ROUTING_COLUMN, Batch, routing_dtype
from megarl.config.training import ActorConfig, reference_replays_routing
from megarl.trainer.steps import shipped

# construction


def test_from_dict_infers_size_and_keeps_rows_as_objects() -> None:
    b = make(3, step=1)
    assert len(b) == 3 and b.meta == {"step": 1}
    assert b["ids"].dtype == object and b["ids"].shape == (3,) and b["ids"][2] == [0, 1, 2]
    square = Batch.from_dict(non_tensors={"m": [[1, 2], [3, 4]], "d": [{"a": 1}, {"a": 2}]})
    assert len(square) == 2 and square["m"].shape == (2,) and square["m"][0] == [1, 2] and square["d"][1] == {"a": 2}
    from_array = Batch.from_dict(non_tensors={"m": np.zeros((2, 3))})
    assert from_array["m"].shape == (2,) and from_array["m"][0].shape == (3,)
    assert len(Batch.from_dict(batch_size=5)) == 5 and Batch.from_dict(batch_size=5).keys() == []


def test_dataclass_constructor() -> None:
    b = Batch(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
    assert len(b) == 2 and b.non_tensors == {} and b.meta == {}
    b = Batch(TensorDict({}, batch_size=[2]), {"n": np.array(["a", "b"], dtype=object)}, {"step": 1})
    assert b.keys() == ["n"] and b.meta == {"step": 1}


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="cannot infer the batch size.*batch_size="):
        Batch.from_dict()
    with pytest.raises(ValueError, match=r"tensor 'b' has shape \(2,\); expected dim 0 = 3"):
        Batch.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \(3,\); expected dim 0 = 4"):
        Batch.from_dict(tensors={"a": torch.zeros(3)}, batch_size=4)
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \(\)"):
        Batch.from_dict(tensors={"a": torch.tensor(1.0)}, batch_size=1)
    with pytest.raises(ValueError, match="non-tensor 'n' has 2 rows; expected 3"):
        Batch.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"n": [1, 2]})
    with pytest.raises(TypeError, match="tensor 'a' must be a torch.Tensor, got list"):
        Batch.from_dict(tensors={"a": [1, 2]}, batch_size=2)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="non-tensor 'n' must be a sequence.*got str"):
        Batch.from_dict(non_tensors={"n": "ab"})
    with pytest.raises(ValueError, match=r"keys \['a'\] are both tensors and non-tensors"):
        Batch.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"a": [1, 2]})


def test_check_errors() -> None:
    with pytest.raises(TypeError, match="must be a TensorDict, got dict"):
        Batch({"x": torch.zeros(2)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"1-D batch_size \[B\], got \[2, 3\]"):
        Batch(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(TypeError, match="non-tensor 'n' must be a 1-D numpy object array"):
        Batch(TensorDict({}, batch_size=[2]), {"n": np.array([1, 2])})
    with pytest.raises(ValueError, match="non-tensor 'n' has 3 rows; expected 2"):
        Batch(TensorDict({}, batch_size=[2]), {"n": np.empty(3, dtype=object)})
    b = make(2)
    b.non_tensors["name"] = np.empty(5, dtype=object)
    with pytest.raises(ValueError, match="non-tensor 'name' has 5 rows; expected 2"):
        b.check()


# columns


def test_keys_contains_getitem_and_repr() -> None:
    b = make(3, step=1)
    assert (
        b.tensor_keys == ["x", "y"] and b.non_tensor_keys == ["ids", "name"] and b.keys() == ["x", "y", "ids", "name"]
    )
    assert "x" in b and "ids" in b and "step" not in b and "z" not in b and 3 not in b
    assert torch.equal(b["x"], torch.arange(6).view(3, 2)) and b["name"][1] == "r1"
    with pytest.raises(KeyError, match=r"no key 'zz' in the batch; it has \['x', 'y', 'ids', 'name'\]"):
        b["zz"]
    text = repr(b)
    assert "size=3" in text and "x: (3, 2) torch.int64" in text and "y: (3,) torch.float32" in text
    assert "ids: (3,) object" in text and "meta=['step']" in text


def test_set() -> None:
    b = make(3)
    b.set("z", torch.ones(3, 4))
    b.set("w", [{"a": 1}, {"a": 2}, {"a": 3}])
    assert torch.equal(b["z"], torch.ones(3, 4)) and b["w"][1] == {"a": 2} and b["w"].dtype == object
    b.set("z", ["now", "an", "object"])
    assert "z" in b.non_tensor_keys and "z" not in b.tensor_keys
    b.set("w", torch.zeros(3))
    assert "w" in b.tensor_keys and "w" not in b.non_tensor_keys
    with pytest.raises(ValueError, match=r"tensor 'bad' has shape \(4,\); expected dim 0 = 3"):
        b.set("bad", torch.ones(4))
    with pytest.raises(ValueError, match="non-tensor 'bad' has 2 rows; expected 3"):
        b.set("bad", [1, 2])
    with pytest.raises(TypeError, match="non-tensor 'bad' must be a sequence"):
        b.set("bad", 7)
    assert "bad" not in b


def test_select() -> None:
    b = make(3, step=1, lr=0.1)
    picked = b.select(tensor_keys=["x"], non_tensor_keys=[], meta_keys=["step"])
    assert picked.keys() == ["x"] and picked.meta == {"step": 1} and len(picked) == 3
    assert b.keys() == ["x", "y", "ids", "name"] and b.meta == {"step": 1, "lr": 0.1}
    assert_same(b.select(), b)
    assert b.select(non_tensor_keys=["name"]).keys() == ["x", "y", "name"]
    for kind, kwargs in [("tensor", {"tensor_keys": ["q"]}), ("non-tensor", {"non_tensor_keys": ["q"]})]:
        with pytest.raises(KeyError, match=rf"no {kind} key\(s\) \['q'\]"):
            b.select(**kwargs)
    with pytest.raises(KeyError, match=r"no meta key\(s\) \['q'\] in the batch; its meta keys are \['step', 'lr'\]"):
        b.select(meta_keys=["q"])


def test_pop() -> None:
    b = make(3, step=1, lr=0.1)
    popped = b.pop(tensor_keys=["y"], non_tensor_keys=["ids"], meta_keys=["lr"])
    assert popped.keys() == ["y", "ids"] and popped.meta == {"lr": 0.1} and len(popped) == 3
    assert popped["ids"][2] == [0, 1, 2]
    assert b.keys() == ["x", "name"] and b.meta == {"step": 1} and len(b) == 3
    with pytest.raises(KeyError, match=r"no tensor key\(s\) \['y'\]"):
        b.pop(tensor_keys=["y"])
    with pytest.raises(KeyError, match=r"no non-tensor key\(s\) \['ids'\]"):
        b.pop(tensor_keys=["x"], non_tensor_keys=["ids"])
    with pytest.raises(KeyError, match=r"no meta key\(s\) \['lr'\]"):
        b.pop(meta_keys=["lr"])
    assert b.keys() == ["x", "name"]  # a failed pop removes nothing


def test_union() -> None:
    a = make(3, step=1)
    extra = Batch.from_dict(
        tensors={"x": a["x"].clone(), "v": torch.zeros(3)}, non_tensors={"k": [1, 2, 3]}, meta={"step": 1, "t": 2}
    )
    u = a.union(extra)
    assert u.keys() == ["x", "y", "v", "ids", "name", "k"] and u.meta == {"step": 1, "t": 2}
    assert a.keys() == ["x", "y", "ids", "name"] and a.meta == {"step": 1}
    assert_same(a.union(make(3, step=1)), a)
    with pytest.raises(ValueError, match="union: tensor 'x' differs"):
        a.union(Batch.from_dict(tensors={"x": torch.zeros(3, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="union: tensor 'y' differs"):
        a.union(Batch.from_dict(tensors={"y": torch.arange(3)}))  # equal values, other dtype
    with pytest.raises(ValueError, match="union: non-tensor 'name' differs"):
        a.union(Batch.from_dict(non_tensors={"name": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match="union: meta 'step' differs"):
        a.union(Batch.from_dict(batch_size=3, meta={"step": 2}))
    with pytest.raises(ValueError, match="batch of 3 rows with one of 2 rows"):
        a.union(make(2))


# rows


def test_repeat_interleaved_and_tiled() -> None:
    b = make(2, step=1)
    inter = b.repeat(3)
    assert names(inter) == ["r0", "r0", "r0", "r1", "r1", "r1"] and inter.meta == {"step": 1}
    assert inter["y"].tolist() == [0, 0, 0, 1, 1, 1] and list(inter["ids"]) == [[0]] * 3 + [[0, 1]] * 3
    tiled = b.repeat(2, interleave=False)
    assert names(tiled) == ["r0", "r1", "r0", "r1"] and tiled["x"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert list(tiled["ids"]) == [[0], [0, 1], [0], [0, 1]]
    assert_same(b.repeat(1), b)
    with pytest.raises(ValueError, match="times=0"):
        b.repeat(0)


def test_chunk() -> None:
    b = make(6, step=1)
    chunks = b.chunk(3)
    assert [names(c) for c in chunks] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert chunks[2]["x"].tolist() == [[8, 9], [10, 11]] and all(c.meta == {"step": 1} for c in chunks)
    with pytest.raises(ValueError, match=r"batch of 6 rows into 4 equal parts; call pad_to_multiple\(4\)"):
        b.chunk(4)
    with pytest.raises(ValueError, match="num_chunks=0"):
        b.chunk(0)


def test_split() -> None:
    b = make(6)
    assert [names(p) for p in b.split(4)] == [["r0", "r1", "r2", "r3"], ["r4", "r5"]]
    assert [len(p) for p in b.split(6)] == [6]
    parts = b.split([1, 0, 5])
    assert [names(p) for p in parts] == [["r0"], [], ["r1", "r2", "r3", "r4", "r5"]]
    assert parts[1]["x"].shape == (0, 2)
    with pytest.raises(ValueError, match=r"split sizes \[2, 2\] must be >= 0 and sum to the batch size 6"):
        b.split([2, 2])
    with pytest.raises(ValueError, match="sum to the batch size 6"):
        b.split([7, -1])
    with pytest.raises(ValueError, match="split_size=0"):
        b.split(0)


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (slice(1, 3), ["r1", "r2"]),
        (slice(None, None, -2), ["r3", "r1"]),
        ([3, 0], ["r3", "r0"]),
        ([-1], ["r3"]),
        ([], []),
        (torch.tensor([2, 2]), ["r2", "r2"]),
        (torch.tensor([1], dtype=torch.int32), ["r1"]),
        (np.array([1, 3]), ["r1", "r3"]),
        ([True, False, True, False], ["r0", "r2"]),
        (torch.tensor([True, False, False, True]), ["r0", "r3"]),
        (np.array([False, True, False, False]), ["r1"]),
    ],
)
def test_indexing_rows(index: Any, expected: list[str]) -> None:
    b = make(4, step=3)
    picked = b[index]
    assert names(picked) == expected and picked.meta == {"step": 3}
    assert picked["y"].tolist() == [float(r[1:]) for r in expected] and picked["ids"].dtype == object
    picked.meta["step"] = 4
    assert b.meta == {"step": 3}


def test_indexing_errors() -> None:
    b = make(4)
    for row in (1, np.int64(1), torch.tensor(1)):
        with pytest.raises(TypeError, match=r"use batch\[1:2\]"):
            b[row]  # type: ignore[index]
    with pytest.raises(ValueError, match=r"boolean row mask must have shape \(4,\).*got \(2,\)"):
        b[torch.tensor([True, False])]
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        b[np.ones(5, dtype=bool)]
    with pytest.raises(TypeError, match="1-D integers or booleans"):
        b[torch.tensor([0.5])]
    with pytest.raises(TypeError, match="1-D integers or booleans"):
        b[np.zeros((2, 2), dtype=np.int64)]
    with pytest.raises(IndexError, match="out of range for a batch of 4 rows"):
        b[[0, 4]]


def test_routing_column_dtype_and_the_roles_it_travels_to() -> None:
    """`routed_experts` takes the smallest integer type that holds the expert indices (and -1), and travels only to
    the roles that replay routings (`steps.shipped`): the actor, and the reference under R3 only (under R2 it routes
    live); never the critic or the teacher."""
    dtypes = [routing_dtype(n) for n in (4, 128, 129, 32768, 32769)]
    assert dtypes == [torch.int8, torch.int8, torch.int16, torch.int16, torch.int32]
    tensors = {"input_ids": torch.zeros(2, 3, dtype=torch.long), ROUTING_COLUMN: torch.zeros(2, 3, 4, dtype=torch.int8)}
    batch = Batch.from_dict(tensors, non_tensors={"uid": ["a", "b"]})
    assert shipped(batch, routing=False).tensor_keys == ["input_ids"]
    replaying = shipped(batch, routing=True)
    assert sorted(replaying.tensor_keys) == ["input_ids", ROUTING_COLUMN] and replaying.non_tensor_keys == []
    modes = [reference_replays_routing(ActorConfig(router_replay=mode)) for mode in ("disabled", "R2", "R3")]
    assert modes == [False, False, True]
