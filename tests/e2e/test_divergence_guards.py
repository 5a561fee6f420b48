"""Divergence guards: an optimizer step with a non-finite loss or gradient is skipped on every rank of the role
(2 gloo processes, pipeline and data parallel), N skips in a row stop the run, and so does a rollout-vs-trainer
probability gap over `trainer.log_prob_gap_limit`; `megarl-train` exits non-zero with the reason."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases.divergence_cases import POISONS, rank_poisoned_steps
from cases.megatron_cases import layout, sample_batch, save_random_model, with_training_columns
from conftest import REPO

from megarl.config.trainer import TrainerConfig, guard_problems
from megarl.data.arith import write_parquet
from megarl.megatron.launch import spawn
from megarl.trainer.metrics import check_log_prob_gap
from megarl.workers.base import SkipGuard

EXE = Path(sys.executable).with_name("megarl-train")


def test_non_finite_steps_are_skipped_on_every_rank(tmp_path: Path) -> None:
    """pp2: only the last stage computes the loss, so a NaN loss with finite gradients is seen there alone; dp2
    (distributed optimizer): only rank 0's loss is poisoned. Every rank must skip both, then step."""
    model_dir = save_random_model("qwen2", tmp_path / "qwen2")
    batch = with_training_columns(sample_batch(vocab_size=250, num_rows=8))
    cases = [("pp2", layout(2, pp=2), False, None), ("dp2", layout(2), True, 0)]
    results = spawn(rank_poisoned_steps, 2, model_dir, cases, batch)
    for name, *_ in cases:
        for rank, result in enumerate(results):
            run = result[name]
            initial, *after = run["weights"]
            for poison, weights, metrics in zip(POISONS, after, run["metrics"], strict=True):
                moved = any(not torch.equal(weights[key], initial[key]) for key in initial)
                assert moved == (poison is None), (name, rank, poison)
                assert metrics["skipped"] == float(poison is not None), (name, rank, poison)
                assert math.isnan(metrics["grad_norm"]) == (poison is not None), (name, rank, poison)
            assert run["scheduler_steps"] == 1, (name, rank)  # skipped steps leave the LR schedule alone


def test_skip_guard_stops_at_the_limit_of_skips_in_a_row() -> None:
    guard = SkipGuard("critic", limit=2)
    for skipped in (True, False, True):
        guard.record(skipped, step=5)
    assert guard.in_a_row == 1
    with pytest.raises(RuntimeError, match=r"the critic skipped 2 optimizer steps in a row .* training step 6"):
        guard.record(True, step=6)
    never = SkipGuard("actor", limit=0)
    for _ in range(10):
        never.record(True, step=1)
    assert never.in_a_row == 10


def test_log_prob_gap_warns_then_stops(caplog: pytest.LogCaptureFixture) -> None:
    cfg = TrainerConfig(log_prob_gap_warning=0.05, log_prob_gap_limit=0.5)
    check_log_prob_gap({"rollout_gap/abs_diff/max": 0.01}, cfg)
    check_log_prob_gap({}, cfg)  # no recomputation (bypass): nothing to compare
    assert not caplog.records
    check_log_prob_gap({"rollout_gap/abs_diff/max": 0.2}, cfg)
    assert "trainer.log_prob_gap_warning=0.05" in caplog.text
    for gap in (0.7, math.nan):
        with pytest.raises(RuntimeError, match=r"stopping the run: .* \(> trainer.log_prob_gap_limit=0.5\)"):
            check_log_prob_gap({"rollout_gap/abs_diff/max": gap}, cfg)
    check_log_prob_gap({"rollout_gap/abs_diff/max": 0.7}, TrainerConfig(log_prob_gap_limit=None))


def test_guard_settings_are_validated() -> None:
    assert guard_problems(TrainerConfig()) == []
    bad = TrainerConfig(log_prob_gap_limit=0.0, max_skipped_steps=-1, on_checkpoint_error="ignore")
    assert guard_problems(bad) == [
        "trainer.log_prob_gap_limit=0.0 must be in (0, 1] (a probability gap), or null to never stop on it",
        "trainer.max_skipped_steps=-1 must be >= 0 (0 = never stop)",
        "trainer.on_checkpoint_error='ignore' is unknown; choose one of stop, continue",
    ]


def test_train_stops_after_max_skipped_steps_with_the_reason(tmp_path: Path) -> None:
    """A policy loss that is always NaN: the actor's two mini-batches of step 1 are both skipped, and with
    trainer.max_skipped_steps=2 the run stops there, exits non-zero and says why."""
    write_parquet(tmp_path / "train.parquet", num_rows=16, seed=0, split="train")
    command = [
        str(EXE),
        "--config-name",
        "demo_cpu",
        "model=tiny_dense",
        "trainer.val_before_train=false",
        f"trainer.run_dir={tmp_path / 'run'}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_device=4",
        "algorithm.use_kl_loss=false",
        "algorithm.policy_loss=cases.divergence_cases:nan_policy_loss",
        "trainer.max_skipped_steps=2",
        "trainer.total_training_steps=2",
        "trainer.progress_bar=false",
        "trainer.logger=[console]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    expected = "the actor skipped 2 optimizer steps in a row for a non-finite loss or gradient norm, the last in "
    assert expected + "training step 1 (trainer.max_skipped_steps=2)" in out.stderr, out.stderr[-6000:]
    assert "restart 1/" not in out.stderr  # a guard's stop is not retried (trainer.max_restarts defaults to 3)
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
