"""`trainer.placement=separate` end to end on one CPU machine: the demo task with the actor and the
reference on one slot (the train pool) and the embedded engine on the other (the rollout pool); the
weights reach the engine by broadcast over a gloo group before the first rollout and after every
update, and the engine is never put to sleep. The same run is the synchronous reference of on-policy
fully asynchronous training, which must train exactly what it trained."""

from pathlib import Path

import pytest
from test_trainer_e2e import _command, _metrics, _run
from test_trainer_e2e import arith_files as arith_files  # the module's data fixture

SEPARATE = ("trainer.placement=separate", "trainer.rollout_devices=1", "actor.megatron.tensor_model_parallel_size=1")
OPENAI_AGENT = ("rollout.default_agent=openai", "agents.openai.agent=examples.openai_agent.agent:chat")
LEAN = (
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.dump_rollouts=false",
    "trainer.logger=[console]",
)


@pytest.fixture(scope="module")
def separate_run(arith_files: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The synchronous trainer on separate pools for 2 steps: (run dir, its log)."""
    run_dir = tmp_path_factory.mktemp("separate")
    out = _run(_command(run_dir, arith_files, *LEAN, *SEPARATE))
    return run_dir, out.stdout + out.stderr


def test_demo_trains_on_separate_pools(separate_run: tuple[Path, str]) -> None:
    run_dir, log = separate_run
    assert "rollout: 1 embedded replica(s) on the rollout pool (1 device(s))" in log
    assert "roles: actor + ref on 1 device(s)" in log
    assert "sync: broadcast: each owner rank broadcasts its buckets to every engine rank (gloo)" in log
    records = _metrics(run_dir)
    assert [int(r["step"]) for r in records] == [1, 2]
    for record in records:
        # the engine samples with the weights the trainer scores with (the sync before step 1 included)
        assert record["rollout_gap/abs_diff/max"] < 1e-3, record["step"]
        assert record["sync/bytes"] > 0 and record["actor/grad_norm"] > 0
    engine_log = (run_dir / "engine_logs" / "replica0" / "node0.log").read_text()
    assert engine_log.count("POST /init_weights_update_group") == 1  # one group, kept across syncs
    assert engine_log.count("POST /update_weights_from_distributed") == 3  # at start, after steps 1 and 2
    assert "POST /update_weights_from_tensor" not in engine_log
    assert "_memory_occupation" not in engine_log  # neither released nor resumed: the engine keeps its device


def test_on_policy_fully_async_reproduces_the_synchronous_trainer(
    separate_run: tuple[Path, str], arith_files: list[str], tmp_path: Path
) -> None:
    """async_training.max_staleness=0: the producer rolls out one step's groups at a time, with the synchronous
    trainer's seeds and uids, and the trainer takes them in stream order, so the steps are the same. Its rollouts
    are an agent written only against the `openai` client (examples/openai_agent/agent.py:chat, one completion per
    sample through the agent worker's session server), where the synchronous run's are the single_turn loop: the
    same tokens, sampled with the same seeds, so the same steps."""
    async_args = ("trainer.driver=fully_async", "async_training.max_staleness=0", *OPENAI_AGENT)
    _run(_command(tmp_path / "async", arith_files, *LEAN, *SEPARATE, *async_args))
    sync, on_policy = _metrics(separate_run[0]), _metrics(tmp_path / "async")
    assert [r["async/staleness/max"] for r in on_policy] == [0, 0]
    assert all(
        r["rollout/openai/requests/mean"] == 1.0 and r["rollout/openai/agent_errors/mean"] == 0 for r in on_policy
    )
    assert "rollout/openai/requests/mean" not in sync[0]
    for ours, theirs in zip(on_policy, sync, strict=True):
        assert ours["reward/score/mean"] == theirs["reward/score/mean"]
        assert ours["response_length/mean"] == theirs["response_length/mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
