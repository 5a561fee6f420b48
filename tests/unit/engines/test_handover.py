"""The embedded engine's side of the colocated hand-over, in process: what a release frees and how often it
collects, and that a wake restores the exact weights."""

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from cases.engine_cases import write_engine_config

from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.sampler import RowSampling


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EmbeddedEngine]:
    model = write_engine_config(tmp_path / "model", hidden=64, layers=2)
    engine = EmbeddedEngine(EngineArgs(model_path=str(model), load_format="dummy", enable_weights_cpu_backup=True))
    yield engine
    engine.shutdown()


def _generate(engine: EmbeddedEngine, num_rows: int) -> None:
    """Greedy rows to their end, so the prefix cache holds KV to release."""
    done = threading.Semaphore(0)
    greedy = RowSampling(temperature=0.0, top_p=1.0, top_k=-1, generator=None)
    rows = [
        Sequence(rid=f"r{i}", prompt=[3 + i, 4, 5], sampling=greedy, max_new_tokens=4, stop_ids=frozenset())
        for i in range(num_rows)
    ]
    engine.submit(rows, lambda _: done.release())
    for _ in rows:
        done.acquire()


def _full_collections_during(fn: Callable[[], None]) -> int:
    """How many full (generation 2) collections `fn()` ran, with automatic collection off meanwhile."""
    started: list[str] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            started.append(phase)

    gc.disable()
    gc.callbacks.append(count)
    try:
        fn()
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    return len(started)


def test_release_collects_once_frees_every_weight_and_wake_restores_them(engine: EmbeddedEngine) -> None:
    _generate(engine, 4)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    assert engine.prefix_cache is not None and len(engine.prefix_cache) > 0

    def release() -> None:
        engine.call(lambda: engine.release(["kv_cache", "weights"])).result()

    assert _full_collections_during(release) == 1  # one gc.collect per release, not one per part released
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 0
    held = {name: p.untyped_storage().nbytes() for name, p in engine.model.named_parameters()}
    assert set(held.values()) == {0}, held

    engine.call(lambda: engine.resume(["weights", "kv_cache"])).result()
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, before[name]), name
    _generate(engine, 2)  # serves again
