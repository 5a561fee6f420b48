"""A Batch through Ray's object store comes back equal."""

import tempfile
from collections.abc import Iterator

import pytest
import ray
from cases.batch_cases import assert_same, make

from megarl.batch import Batch


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as tmp:
        ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        yield
        ray.shutdown()


def test_ray_round_trip(local_ray: None) -> None:
    b = make(3, step=1)
    assert_same(ray.get(ray.put(b)), b)
    size, doubled = ray.get(_double_y.remote(b))
    assert size == 3 and doubled["y"].tolist() == [0.0, 2.0, 4.0] and doubled.meta == {"step": 1, "seen": True}
    assert list(doubled["ids"]) == list(b["ids"]) and b.meta == {"step": 1}


@ray.remote
def _double_y(batch: Batch) -> tuple[int, Batch]:
    batch.set("y", batch["y"] * 2)
    batch.meta["seen"] = True
    return len(batch), batch
