"""`megarl-train` end to end on CPU: Ray pools, Megatron TP=2 over gloo, two embedded engines,
resharding, agent loops and the driver, for a few GRPO steps; then an actor rank SIGKILLed while an asynchronous
checkpoint is in flight, the run restarting itself from the previous checkpoint and reproducing the uninterrupted
run; a PPO run with a critic; bad configs refused up front."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cases.reward_cases import save_classifier
from conftest import REPO
from transformers import AutoModelForCausalLM

from megarl.algo import group_ids_from_uids
from megarl.data.arith import write_parquet
from megarl.trainer.rollout_dump import load_rollout_batches

EXE = Path(sys.executable).with_name("megarl-train")
PHASES = ("gen", "engine_sleep", "old_log_prob", "ref", "reward", "adv", "update_actor", "sync", "step")


@pytest.fixture(scope="module")
def arith_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("arith")
    write_parquet(root / "train.parquet", num_rows=64, seed=0, split="train")
    write_parquet(root / "test.parquet", num_rows=8, seed=1, split="test")
    return [f"data.train_files=[{root}/train.parquet]", f"data.val_files=[{root}/test.parquet]"]


def _command(run_dir: Path, data: list[str], *extra: str) -> list[str]:
    return [
        str(EXE),
        "--config-name",
        "demo_cpu",
        "model=tiny_dense",
        "trainer.val_before_train=false",
        f"trainer.run_dir={run_dir}",
        *data,
        "data.train_batch_size=4",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_device=8",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.progress_bar=false",
        "trainer.dump_rollouts=true",
        "reward.function=cases.trainer_cases:varied_reward",
        *extra,
    ]


def _env() -> dict[str, str]:
    """trainer_cases (tests/) provides `varied_reward`, whose scores differ between a random policy's
    samples, so every step has non-zero advantages and the policy moves."""
    path = f"{REPO}{os.pathsep}{REPO / 'tests'}"  # this checkout first, as the Ray workers (they start in the cwd)
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": path}


def _run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _kill_after_checkpoint(command: list[str], run_dir: Path, step: int, timeout: float = 600) -> None:
    """Start the run in its own process group; SIGKILL the group once `step`'s checkpoint is committed."""
    proc = subprocess.Popen(
        command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    try:
        while not (latest.is_file() and latest.read_text().strip() == f"global_step_{step}"):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before checkpoint {step}"
            assert time.monotonic() < deadline, f"no checkpoint {step} within {timeout}s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _processes_with(marker: str) -> list[int]:
    """PIDs whose environment holds `marker` (every process a run started inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _actor_rank_pid(marker: str) -> int:
    for pid in _processes_with(marker):
        try:
            if b"ray::ActorWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no actor rank process")


def _kill_actor_mid_save(command: list[str], run_dir: Path, marker: str, timeout: float = 600) -> str:
    """Run `command` (its output in `<run_dir>.log`); SIGKILL an actor rank once a save after the first is staged and
    not yet committed, and wait for the run to finish. Returns the checkpoint `latest` named at the kill."""
    checkpoints = run_dir / "checkpoints"
    env = _env() | dict([marker.split("=")])
    with run_dir.with_suffix(".log").open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not (kept := _in_flight(checkpoints)):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) with no save caught in flight"
            assert time.monotonic() < deadline, f"no save in flight within {timeout}s"
            time.sleep(0.005)
        os.kill(_actor_rank_pid(marker), signal.SIGKILL)
        assert proc.wait(timeout=timeout) == 0, run_dir.with_suffix(".log").read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return kept


def _in_flight(checkpoints: Path) -> str | None:
    """What `latest` names while a later save is staged (its `.global_step_<k>.partial/actor` exists), else None."""
    latest = checkpoints / "latest"
    if not latest.is_file() or not list(checkpoints.glob(".global_step_*.partial/actor")):
        return None
    return latest.read_text().strip()


LORA = ("+experiment=tiny_lora", "actor.optim.lr=1e-3")
"""LoRA adapters (the CPU demo's experiment): rank 16, synced as adapters the engines load each step."""
RESTART = ("trainer.save_freq=1", "trainer.max_restarts=1", "trainer.restart_backoff_s=0")
"""A save every step (asynchronous: each in flight while its step goes on) and one restart."""


def test_grpo_end_to_end_then_a_rank_killed_mid_save_restarts_the_run(arith_files: list[str], tmp_path: Path) -> None:
    """With LoRA (full fine-tuning's kill and resume: tests/e2e/test_async_training.py)."""
    full_dir = tmp_path / "full"
    out = _run(_command(full_dir, arith_files, "trainer.logger=[console,tensorboard]", *LORA))
    log = out.stdout + out.stderr
    assert "64 training prompts (0 over-long dropped), 16 steps/epoch, 4 steps planned" in log
    assert "actor: 4 prompts × n=4 = 16 trajectories/step → 2 mini-batch(es) of 8 over DP=1 = 8 per DP rank" in log
    assert "roles: actor + ref on 2 device(s) (the actor with its LoRA adapters off)" in log
    # colocated: the engines hand their memory back before any trainer role is built
    assert log.index("rollout: engines released kv_cache+weights for the trainer") < log.index("roles: actor")
    full = _metrics(full_dir)
    assert [int(r["step"]) for r in full] == [1, 2, 3, 4]
    for record in full:
        for phase in PHASES:
            assert record[f"timing/{phase}"] > 0, (phase, record["step"])
        assert record["rollout_gap/abs_diff/max"] < 1e-3  # fp32 engine and trainer on the same weights
        assert record["rollout_gap/kl"] < 1e-6
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/kl_loss"])
        assert record["actor/grad_norm"] > 0
        assert record["sync/bytes"] > 0
        assert record["actor/kl_loss"] > 0 or record["step"] == 1  # the adapters move the policy off the base
        # the start-up sync carried the base, each step's the adapter alone (the engines keep the base asleep)
        assert record["sync/bytes"] == full[0]["sync/bytes"] < 0.1 * record["sync/bytes_skipped"]
    model_bytes = full[0]["sync/bytes_skipped"]  # the whole model, in the engine's dtype (fp32, as trained)
    actor_ckpt = full_dir / "checkpoints" / "global_step_2" / "actor"
    assert sum(f.stat().st_size for f in (actor_ckpt / "model").iterdir()) < 0.2 * model_bytes  # adapters only
    assert "val/reward/score/mean" in full[1] and "val/megarl/arith/score/mean" in full[3]
    assert {"val/megarl/arith/mean@1", "val/megarl/arith/pass@1"} <= set(full[1])  # greedy, one sample per prompt
    assert not any("best@" in key or "maj@" in key for key in full[1])
    assert "val/reward/score/mean" not in full[0]
    assert sorted(p.name for p in (full_dir / "checkpoints").glob("global_step_*")) == [
        "global_step_2",
        "global_step_4",
    ]
    assert (full_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((full_dir / "tensorboard").glob("events.*"))
    dumps = [json.loads(line) for line in (full_dir / "rollout_dumps" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumps) == 16 and {"prompt", "response", "score"} <= set(dumps[0])

    # the same run, its actor rank SIGKILLed while an asynchronous save is in flight (staged, not committed): it
    # restarts itself from the previous checkpoint, and from there trains as the uninterrupted run did
    restarted_dir, marker = tmp_path / "restarted", f"MEGARL_TEST_RUN={uuid.uuid4().hex}"
    command = _command(restarted_dir, arith_files, "trainer.logger=[console]", *LORA, *RESTART)
    kept = _kill_actor_mid_save(command, restarted_dir, marker)
    log = (restarted_dir.parent / "restarted.log").read_text()
    assert kept in ("global_step_1", "global_step_2", "global_step_3"), kept
    assert re.search(
        r"restart 1/1 in 0 s from the latest checkpoint \(trainer.max_restarts\) after: actor rank \d "
        r"\(Ray actor megarl-actor-\d on node [\d.]+\) died in",
        log,
    ), log[-3000:]
    assert f"resumed from {restarted_dir / 'checkpoints' / kept}" in log
    assert _processes_with(marker) == [], "a process of the run survived it"
    restarted = _metrics(restarted_dir)
    assert [int(r["step"]) for r in restarted] == [1, 2, 3, 4]  # each step logged once
    resumed_at = int(kept.rsplit("_", 1)[1])
    for ours, theirs in zip(restarted[resumed_at:], full[resumed_at:], strict=True):
        assert ours["reward/score/mean"] == theirs["reward/score/mean"]
        assert ours["response_length/mean"] == theirs["response_length/mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_ppo_with_critic_runs_with_offloaded_reference_and_critic(arith_files: list[str], tmp_path: Path) -> None:
    """Also scored by a discriminative RM as a Megatron role colocated and offloaded (back on the device only to
    score; the fully asynchronous run covers every reward source, on separate pools)."""
    run_dir = tmp_path / "ppo"
    rm = save_classifier(tmp_path / "rm")
    _run(
        _command(
            run_dir,
            arith_files,
            "algorithm=ppo",
            "trainer.total_training_steps=2",
            "trainer.critic_warmup=1",
            "rollout.val.n=2",
            "rollout.val.temperature=1.0",
            "trainer.save_freq=0",
            "trainer.save_hf_weights=true",  # the last step's (asynchronous) checkpoint, its actor exported as HF
            "trainer.dump_rollouts=false",
            "critic.ppo_mini_batch_size=2",
            "ref.offload=true",
            "critic.offload=true",
            "critic.megatron.context_parallel_size=2",  # each packed trajectory split over the 2 slots
            "reward_model.discriminative.enable=true",
            f"reward_model.discriminative.path={rm}",
        )
    )
    records = _metrics(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2]
    hf = run_dir / "checkpoints" / "global_step_2" / "actor" / "hf"
    exported = AutoModelForCausalLM.from_pretrained(hf)  # committed with the checkpoint it was written from
    assert (
        exported.config.num_hidden_layers == 2
        and not (run_dir / "checkpoints" / "global_step_2" / "critic" / "hf").exists()
    )
    for record in records:
        for phase in ("values", "update_critic", "ref"):
            assert record[f"timing/{phase}"] > 0
        assert math.isfinite(record["critic/vf_loss"])
        # CP=2 leaves DP=1: one rank's micro-batches, every trajectory rounded up to 2·CP tokens
        assert record["critic/packing/micro_batches_per_rank"] >= 1
        assert 0 < record["critic/packing/real_tokens"] <= record["critic/packing/computed_tokens"]
        # both left the device before every sync; the critic also takes gradients and Adam state along
        assert record["offload/critic_bytes"] > record["offload/ref_bytes"] > 0
        assert record["timing/rm"] > 0 and record["reward/rm/mean"] != 0.0  # restored to score, released again
        assert record["reward/score/mean"] == pytest.approx(record["reward/rule/mean"] + record["reward/rm/mean"])
    assert "timing/update_actor" not in records[0] and records[1]["timing/update_actor"] > 0  # critic warm-up
    # validation at the last step (trainer.test_freq=2), 2 samples per prompt: the n-sample metrics, no maj@2
    # (varied_reward sets no answer)
    val = {key.removeprefix("val/megarl/arith/") for key in records[1] if key.startswith("val/megarl/arith/")}
    assert val == {"score/mean", "mean@2", "pass@1", "pass@2", "best@2", "worst@2"}
    assert records[1]["val/megarl/arith/best@2"] >= records[1]["val/megarl/arith/mean@2"]
    assert not any(key.startswith("val/") for key in records[0])
    assert (run_dir / "checkpoints" / "global_step_2" / "critic").is_dir()


def test_bad_config_fails_before_any_worker(arith_files: list[str], tmp_path: Path) -> None:
    command = _command(
        tmp_path / "bad",
        arith_files,
        "actor.megatron.tensor_model_parallel_size=3",
        "actor.ppo_mini_batch_size=3",
        "data.val_files=[/no/such/file.parquet]",
    )
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    assert out.returncode == 2
    assert "actor.megatron.tensor_model_parallel_size=3" in out.stderr
    assert "actor.ppo_mini_batch_size=3" in out.stderr
    assert "data.val_files: /no/such/file.parquet does not exist" in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "bad" / "config.yaml").exists() and not (tmp_path / "bad" / "engine_logs").exists()
    assert time.monotonic() - started < 60


def test_rollout_only_then_train_only_with_remax_and_dynamic_sampling(arith_files: list[str], tmp_path: Path) -> None:
    """rollout_only saves scored batches (ReMax baselines, DAPO-filtered groups, reward extras); train_only
    trains on them without any engine, with losses and estimators chosen on the command line: DPPO-TV with
    asymmetric bounds and batch-normalised rollout-correction weights, with the optimal token baseline without
    its zero tail (Σπ² from the actor's pass); then bypass (no old-log-prob pass) with sequence-level weights in
    the IcePop band, with GDPO over the reward function's two components."""
    run_dir, data_dir = tmp_path / "split", tmp_path / "rollouts"
    common = [
        f"trainer.rollout_data_dir={data_dir}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.dump_rollouts=false",
    ]
    sampling = ["algorithm.adv_estimator=remax", "algorithm.filter_groups.enable=true"]
    out = _run(
        _command(
            run_dir,
            arith_files,
            "trainer.driver=rollout_only",
            "algorithm.filter_groups.max_num_gen_batches=20",
            *sampling,
            *common,
        )
    )
    assert "roles:" not in out.stdout + out.stderr  # no Megatron role was started
    batches = load_rollout_batches(data_dir)
    assert [step for step, _ in batches] == [1, 2]
    for _, batch in batches:
        assert len(batch) == 16 and "baseline_scores" in batch and "rollout_log_probs" in batch
        assert set(batch["reward_extra"][0]) == {"odd_length", "has_digit"}
        groups = group_ids_from_uids(batch["uid"])
        for g in groups.unique():
            assert batch["scores"][groups == g].unique().numel() > 1  # dynamic sampling kept varied groups only
    rollout_metrics = _metrics(run_dir)
    assert all(r["dynamic_sampling/rounds"] >= 1 for r in rollout_metrics)

    dppo = [
        "algorithm.policy_loss=dppo_tv",
        "algorithm.loss_params.dppo_tv_delta_high=0.28",
        "algorithm.loss_params.dppo_tv_delta_low=0.2",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.batch_normalize=true",
        "algorithm.adv_estimator=optimal_token_baseline",
        "algorithm.otb_handle_zero_tail=false",
    ]
    out = _run(_command(tmp_path / "otb", arith_files, "trainer.driver=train_only", *dppo, *common))
    assert "rollout:" not in out.stdout + out.stderr  # no engine was started
    trained = _metrics(tmp_path / "otb")
    assert [int(r["step"]) for r in trained] == [1, 2]
    for record in trained:
        assert math.isfinite(record["actor/pg_loss"]) and record["timing/update_actor"] > 0
        assert "actor/dppo_ratio_capped_frac" in record  # the loss given on the command line ran
        assert record["actor/rollout_corr/batch_norm_factor"] > 0  # the driver's batch mean reached the loss
        assert "rollout_gap/abs_diff/max" in record  # the engine's dummy weights are not the trainer's init

    gdpo = [
        "algorithm.policy_loss=bypass",
        "algorithm.loss_params.bypass_is_level=sequence",
        "algorithm.loss_params.bypass_is_lower=0.5",
        "algorithm.adv_estimator=gdpo",
        "+algorithm.reward_weights.odd_length=1.0",
        "+algorithm.reward_weights.has_digit=0.5",
    ]
    _run(_command(tmp_path / "gdpo", arith_files, "trainer.driver=train_only", *gdpo, *common))
    for record in _metrics(tmp_path / "gdpo"):
        assert math.isfinite(record["actor/pg_loss"]) and "actor/rollout_is_weight_mean" in record
        assert 0 <= record["actor/rollout_is_masked_frac"] <= 1  # IcePop's band, not the truncation
        assert "timing/old_log_prob" not in record  # bypass trains on the rollout's log-probs
        assert "rollout_gap/abs_diff/max" not in record  # nothing recomputed, so no gap is claimed


def test_moe_experiment_trains_replaying_the_engines_routing(arith_files: list[str], tmp_path: Path) -> None:
    """`+experiment=tiny_moe_ep2` (EP2, R3): the engine returns every token's experts, the trainer replays them. Same
    weights in fp32, so the trainer's own top-k agrees with the engine's on every token with a record: a routing
    placed one token off, or in the wrong row, would not."""
    run_dir = tmp_path / "moe"
    command = [
        str(EXE),
        "+experiment=tiny_moe_ep2",
        f"trainer.run_dir={run_dir}",
        arith_files[0],
        "data.val_files=[]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        "trainer.progress_bar=false",
        "trainer.logger=[console]",
        "reward.function=cases.trainer_cases:varied_reward",
    ]
    _run(command)
    records = _metrics(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2]
    for record in records:
        assert record["router_replay/rollout_mismatch_frac"] == 0.0
        assert record["actor/router_replay/mismatch_frac"] >= 0.0
        assert record["rollout_gap/abs_diff/max"] < 1e-4
