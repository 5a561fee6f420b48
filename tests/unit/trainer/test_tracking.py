"""Metric sinks, the metrics file across a resume, the plot, and rollouts on disk."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.batch import Batch
from megarl.trainer.plot import plot_metrics
from megarl.trainer.rollout_dump import dump_rollouts, load_rollout_batches, read_rollouts, save_rollout_batch
from megarl.trainer.tracking import Tracker, read_metrics


def test_metrics_file_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(["console", "tensorboard"], tmp_path, "p", "e", {})
    for step in (1, 2, 3):
        tracker.log({"reward/score/mean": step / 10, "timing/step": 1.0}, step)
    tracker.close()
    assert [r["reward/score/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.1, 0.2, 0.3]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [round(e.value, 4) for e in events.Scalars("reward/score/mean")] == [0.1, 0.2, 0.3]


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path: Path) -> None:
    first = Tracker([], tmp_path, "p", "e", {})
    for step in range(1, 6):
        first.log({"x": float(step)}, step)
    resumed = Tracker([], tmp_path, "p", "e", {}, resume=True)
    resumed.log({"x": 40.0}, 4)
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_wandb_offline_writes_a_local_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(["wandb"], tmp_path, "megarl-test", "offline-run", {"lr": 1e-3})
    tracker.log({"reward/score/mean": 0.5}, 1)
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # ready for `wandb sync`
    assert len(runs) == 1
    # wandb's service process may still be writing the records after `finish` returns (seen once in a
    # loaded full suite: the file held only its header): wait for them, up to 30 s
    deadline = time.monotonic() + 30
    while b"reward/score/mean" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b"reward/score/mean" in runs[0].read_bytes()


def test_unknown_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer.logger"):
        Tracker(["mlflow"], tmp_path, "p", "e", {})


def test_plot_writes_a_png_of_the_present_keys(tmp_path: Path) -> None:
    records = [{"step": s, "reward/score/mean": s / 10} for s in range(1, 6)]
    records[4]["val/reward/score/mean"] = 0.3
    out = plot_metrics(records, tmp_path / "m.png", ["reward/score/mean", "val/reward/score/mean", "absent"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_metrics(records, tmp_path / "n.png", ["absent"])


def test_rollouts_on_disk_round_trip(tmp_path: Path) -> None:
    dump_rollouts(tmp_path / "d" / "step_1.jsonl", 1, ["killed"], ["run"], [0.0])
    dump_rollouts(tmp_path / "d" / "step_1.jsonl", 1, ["p0", "p1"], ["r0", "r1"], [0.0, 1.0], {"uid": ["a", "b"]})
    assert len(read_rollouts(tmp_path / "d" / "step_1.jsonl")) == 2  # the step's second dump replaces its first
    assert read_rollouts(tmp_path / "d" / "step_1.jsonl")[1] == {
        "step": 1,
        "prompt": "p1",
        "response": "r1",
        "score": 1.0,
        "uid": "b",
    }
    with pytest.raises(FileNotFoundError, match="trainer.driver=rollout_only"):
        load_rollout_batches(tmp_path / "none")
    batch = Batch.from_dict({"x": torch.arange(6).view(3, 2)}, {"s": np.array(["a", "b", "c"], dtype=object)})
    save_rollout_batch(tmp_path / "b", 2, batch)
    save_rollout_batch(tmp_path / "b", 1, batch[:1])
    loaded = load_rollout_batches(tmp_path / "b")
    assert [step for step, _ in loaded] == [1, 2]
    assert torch.equal(loaded[1][1]["x"], batch["x"]) and list(loaded[1][1]["s"]) == ["a", "b", "c"]
