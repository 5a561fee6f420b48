"""Asynchronous training end to end on one CPU machine (1 trainer slot + 1 engine slot, separate pools):
fully async with bounded staleness and partial rollouts, scored as trajectories finish by every kind of reward
source (the rule, a Megatron RM, a judge on a third slot, a flaky reward service), that run killed after its
step-2 checkpoint and resumed, training every prompt exactly once, one-step-off, and an engine killed mid-run (two
engine slots) that comes back at the next push (on-policy fully async against the synchronous trainer:
test_separate_pools.py)."""

import json
import math
import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from cases.megatron_cases import save_asset_model
from cases.reward_cases import FlakyService, save_classifier, save_judge, serve_flaky
from test_fault_tolerance import _engine_pid, _steps, _wait_for
from test_trainer_e2e import LORA, REPO, _command, _env, _kill_after_checkpoint, _metrics, _run
from test_trainer_e2e import arith_files as arith_files  # the module's data fixture

from megarl.assets import asset_path

SEPARATE = ("trainer.placement=separate", "trainer.rollout_devices=1", "actor.megatron.tensor_model_parallel_size=1")
FULLY_ASYNC = (*SEPARATE, "trainer.driver=fully_async")
N = 4
"""rollout.n of `_command`."""


def _dumps(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "rollout_dumps").glob("step_*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


ASYNC_OPTIONS = (
    *FULLY_ASYNC,
    # the producer may start 3 steps' groups on the step-0 weights, one group at a time (128 tokens each): the
    # bound can be reached (step 3 training step-0 samples) and step 4's groups must wait for update 1
    "async_training.max_staleness=2",
    "async_training.pause_mode=abort",  # the agent side resubmits prompt + partial response
    "async_training.max_in_flight=1",
    "data.max_response_length=128",
    "algorithm.rollout_correction.level=token",  # decoupled PPO: IS weight π_old / π_rollout
    "trainer.save_freq=2",
    "trainer.test_freq=4",  # validation after the last step, with the producer still running
    "trainer.logger=[console]",
    *LORA,  # each push loads a new adapter into the engine while requests on the previous one are in flight
)


REWARD_WEIGHTS = {"rule": 1.0, "rm": 0.5, "judge": 0.25, "remote": 0.5}


def _reward_models(root: Path, service_url: str) -> tuple[str, ...]:
    """Every kind of reward source at once, beside the rule: a Megatron RM role on the trainer's slot, a tiny judge
    on an embedded engine of its own (a third slot), and the flaky service (20% of calls fail, retried)."""
    rm, judge = save_classifier(root / "rm"), save_judge(root / "judge")
    weights = tuple(f"reward_model.{name}.weight={REWARD_WEIGHTS[key]}" for key, name in _SOURCES.items())
    return (
        "trainer.devices_per_node=3",
        f"reward_model.rule_weight={REWARD_WEIGHTS['rule']}",
        *weights,
        "reward_model.discriminative.enable=true",
        f"reward_model.discriminative.path={rm}",
        "reward_model.generative.enable=true",
        f"reward_model.generative.path={judge}",
        "reward_model.generative.parser=yes_no",
        "reward_model.generative.yes_no_tokens=[Y,N]",
        f"reward_model.remote.url={service_url}",
        "reward_model.remote.retry.max_retries=8",
        "reward_model.remote.retry.backoff_s=0.05",
    )


_SOURCES = {"rm": "discriminative", "judge": "generative", "remote": "remote"}


def _teacher(root: Path, backend: str) -> tuple[str, ...]:
    """On-policy distillation from a random tiny_dense of another seed, mixed with the task's advantage."""
    teacher = save_asset_model("tiny_dense", root / "teacher", seed=3)
    return (
        "algorithm.distillation.enable=true",
        f"algorithm.distillation.teacher.path={teacher}",
        f"algorithm.distillation.teacher.tokenizer_path={asset_path('tokenizer')}",
        f"algorithm.distillation.teacher.backend={backend}",
        "algorithm.distillation.kl_coef=0.1",
        "algorithm.distillation.reward_coef=1.0",
    )


def _distilled(records: list[dict[str, float]]) -> None:
    """Every step's advantage read the teacher: its per-token reverse KL estimate is logged, finite and not 0."""
    for record in records:
        assert math.isfinite(record["distill/reverse_kl"]) and record["distill/reverse_kl"] != 0
        assert record["distill/teacher_log_prob"] < 0


@pytest.fixture(scope="module")
def fully_async_run(arith_files: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FlakyService, str]:
    """4 fully asynchronous steps with LoRA adapters synced as adapters, checkpoints at 2 and 4, scored by the rule, a
    Megatron RM, a judge on its own engine and a reward service failing 20% of its calls: SIGKILLed (its whole process
    group) once checkpoint 2 is committed, with groups in flight, then run again with the same command, which resumes
    from it and trains steps 3 and 4. Returns the run directory, the service and the resumed run's log."""
    run_dir = tmp_path_factory.mktemp("fully_async")
    with serve_flaky() as service:
        rewards = _reward_models(tmp_path_factory.mktemp("reward_models"), service.url)
        teacher = _teacher(tmp_path_factory.mktemp("teacher"), "megatron")
        command = _command(run_dir, arith_files, *ASYNC_OPTIONS, *rewards, *teacher)
        _kill_after_checkpoint(command, run_dir, step=2)
        out = _run(command)
    log = out.stdout + out.stderr
    assert "+ rm + teacher on 1 device(s)" in log  # RM and teacher: Megatron roles by the actor
    return run_dir, service, log


def test_fully_async_bounds_staleness_and_records_every_tokens_version(
    fully_async_run: tuple[Path, FlakyService, str],
) -> None:
    """Whether a group is still generating when an update lands is a race between the producer and the trainer
    (on CI's 2 busy cores the producer sometimes finished every admitted group first), so this run checks what
    holds either way; tests/dist/test_partial_rollouts.py pauses a generation mid-way on purpose and checks the
    tokens of both versions, with the same router that resubmits aborted samples here. Steps 1 and 2 are the killed
    run's, 3 and 4 the resumed run's."""
    run_dir, _, _ = fully_async_run
    records = _metrics(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2, 3, 4]
    _distilled(records)  # the Megatron teacher scored each step's groups, of whatever weight versions
    for record in records:
        assert record["async/staleness/max"] <= 2
        assert math.isfinite(record["actor/rollout_corr/weight_mean"]) and "actor/rollout_corr/ess" in record
        assert {"async/buffer_depth", "async/trainer_idle_s", "async/engine_idle_s", "async/samples_per_s"} <= set(
            record
        )
    assert records[0]["async/staleness/max"] == 0  # step 1 trains what the step-0 weights sampled
    for record in records:  # the base went with the start-up sync: each push is an adapter (with the base: skipped)
        assert 0 < record["sync/bytes"] < 0.1 * record["sync/bytes_skipped"]
    assert "val/reward/score/mean" in records[3] and "val/reward/score/mean" not in records[2]
    rows = _dumps(run_dir)
    assert len(rows) == 4 * 4 * N
    for row in rows:
        assert row["versions"] and min(row["versions"]) >= row["step"] - 3  # current version step − 1; bound 2
    for record in records:  # the metric and the dumps count the same rows that span two versions
        spans = [len(row["versions"]) > 1 for row in rows if row["step"] == int(record["step"])]
        assert record["async/multi_version_frac"] == pytest.approx(sum(spans) / len(spans))


def test_one_step_off_trains_on_the_previous_steps_rollout(arith_files: list[str], tmp_path: Path) -> None:
    """With a distillation teacher on an embedded engine of its own (a third slot), scoring each trajectory as its
    loop ends."""
    run_dir = tmp_path / "one_step_off"
    options = ("trainer.driver=one_step_off", "trainer.total_training_steps=3", "trainer.test_freq=2")
    teacher = (*_teacher(tmp_path, "engine"), "trainer.devices_per_node=3")
    options += ("trainer.save_freq=0", "trainer.logger=[console]")
    out = _run(_command(run_dir, arith_files, *SEPARATE, *options, *teacher))
    assert "reward: teacher on 1 replica(s)" in out.stdout + out.stderr
    records = _metrics(run_dir)
    _distilled(records)
    assert [r["async/staleness/max"] for r in records] == [0, 1, 1]
    assert [r["async/staleness/mean"] for r in records] == [0, 1, 1]
    assert all(r["actor/grad_norm"] > 0 for r in records)
    assert "val/reward/score/mean" in records[1] and "val/reward/score/mean" in records[2]


def test_model_rewards_score_every_trajectory_as_it_finishes(
    fully_async_run: tuple[Path, FlakyService, str],
) -> None:
    """Each trajectory's score is the weighted sum of its components (in the dumps); the service's failures were
    retried and counted, and it scored every trajectory; the RM (after rollout, on the trainer) read each one."""
    run_dir, service, _ = fully_async_run
    records, rows = _metrics(run_dir), _dumps(run_dir)
    for record in records:
        assert {f"reward/{name}/mean" for name in REWARD_WEIGHTS} <= set(record)
        assert record["reward/errors"] == 0.0 and "timing/rm" in record
    assert service.failures > 0 and sum(record["reward/retries"] for record in records) > 0
    assert {row["uid"] for row in rows} and len(service.scored) >= len(rows)  # validation's rows are scored too
    for row in rows:
        reward = row["reward"]
        assert row["score"] == pytest.approx(sum(w * reward[name] for name, w in REWARD_WEIGHTS.items()), abs=1e-5)
        assert 0.0 < reward["judge"] < 1.0  # P(Y) / (P(Y) + P(N)) from the judge's log-probs
        assert reward["remote"] == len(row["response"]) % 5 / 4  # the service's own score, after any retries
    assert len({round(row["reward"]["rm"], 6) for row in rows}) > 1


def test_fully_async_kill_and_resume_trains_every_prompt_once(fully_async_run: tuple[Path, FlakyService, str]) -> None:
    """The prompts trained across the killed run and its resume are those an uninterrupted run trains: the stream's
    first 4 × 4 prompts, each exactly once (rollout.n rows per uid), although groups were in flight at the kill; every
    step is logged once."""
    run_dir, _, log = fully_async_run
    owed = re.search(r"async: resuming with (\d+) drawn prompt group", log)
    assert "resumed from" in log and owed is not None
    assert int(owed.group(1)) > 0  # groups were in flight or buffered at the kill: they must not be lost
    trained = Counter(r["uid"] for r in _dumps(run_dir))
    assert set(trained) == {f"{step}.1:{i}" for step in range(1, 5) for i in range(4)}
    assert set(trained.values()) == {N}
    assert [int(r["step"]) for r in _metrics(run_dir)] == [1, 2, 3, 4]


def test_fully_async_restarts_an_engine_killed_mid_run(arith_files: list[str], tmp_path: Path) -> None:
    """Two engines on a rollout pool of their own (1 trainer slot + 2 engine slots): one SIGKILLed after step 1 is
    restarted before the next push, joins a new weight-update group, takes the weights in full and is readmitted
    once its peer continued (`fully_async._push`); the run logs every step once."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    separate = ("trainer.placement=separate", "trainer.rollout_devices=2", "trainer.devices_per_node=3")
    lean = ("trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.logger=[console]")
    options = (*separate, "actor.megatron.tensor_model_parallel_size=1", "trainer.driver=fully_async", *lean)
    options += ("trainer.max_restarts=0",)  # the engine recovers in place, not the run
    with log.open("w") as out:
        proc = subprocess.Popen(_command(run_dir, arith_files, *options), cwd=REPO, env=_env(), stdout=out, stderr=out)
    try:
        _wait_for(lambda: len(_steps(run_dir)) >= 1, proc, "step 1")
        url = re.search(r"replica\(s\) on the rollout pool .* at (\S+),", log.read_text()).group(1)  # type: ignore[union-attr]
        os.kill(_engine_pid(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    records = _steps(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2, 3]
    readmitted = [r for r in records if "engines/live_replicas" in r]  # the push of step 2 took it back
    assert [(int(r["step"]), r["engines/restarts"], r["engines/live_replicas"]) for r in readmitted] == [(2, 1, 2)]
    engine_log = (run_dir / "engine_logs" / "replica0" / "node0.log").read_text()
    assert engine_log.count("POST /init_weights_update_group") == 2  # the restarted engine joined a new group
