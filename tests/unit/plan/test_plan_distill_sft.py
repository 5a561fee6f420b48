"""The gate on `trainer.mode=sft` and `algorithm.distillation`: RL-only keys in SFT, the teacher's tokenizer, its
layout and pool, each a named error before anything starts."""

import shutil
from pathlib import Path

import pytest
from conftest import compose_config

from megarl.assets import asset_path
from megarl.config import ConfigError
from megarl.plan.distill import distill_gate_problems, tokenizer_problems
from megarl.plan.facts import batch_sizes, reference_needed, reward_pool_devices, training_devices
from megarl.plan.gate import validate
from megarl.plan.report import build_plan, format_plan

TEACHER = (
    "algorithm.distillation.enable=true",
    f"algorithm.distillation.teacher.path={asset_path('models/tiny_dense')}",
)


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(*overrides), check_files=False)
    return str(err.value)


def test_sft_refuses_rl_only_keys_by_name() -> None:
    text = _problems(
        "trainer.mode=sft",
        "critic.enable=true",
        "trainer.driver=fully_async",
        "reward_model.generative.enable=true",
        *TEACHER,
    )
    for key in ("critic.enable=true", "trainer.driver=fully_async", "reward_model.generative.enable=true"):
        assert f"trainer.mode=sft does not use {key}" in text
    assert "trainer.mode=sft does not use algorithm.distillation.enable=true" in text
    assert "trainer.mode=bogus is unknown" in _problems("trainer.mode=bogus").replace("'", "")


def test_sft_reads_one_row_per_conversation_and_no_reference() -> None:
    """The base config's RL defaults (rollout.n=8, a KL loss) are not read in SFT: no error, n = 1, no reference."""
    cfg = compose_config(
        "trainer.mode=sft", "trainer.devices_per_node=2", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8"
    )
    validate(cfg, check_files=False)
    sizes = batch_sizes(cfg, "actor")
    assert (sizes.trajectories_per_step, sizes.trajectories_per_mini_batch) == (16, 8)
    assert not reference_needed(cfg)


def test_teacher_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(tmp_path / "tok")
    [text] = tokenizer_problems(str(asset_path("tokenizer")), str(tmp_path / "tok"))
    assert "algorithm.distillation.teacher: its tokenizer" in text and "<teacher-only>" in text
    assert tokenizer_problems(str(asset_path("tokenizer")), str(asset_path("tokenizer"))) == []
    shutil.copy(asset_path("models/tiny_dense") / "config.json", tmp_path / "config.json")
    cfg = compose_config(
        "algorithm.distillation.enable=true",
        f"algorithm.distillation.teacher.path={tmp_path}",
        f"algorithm.distillation.teacher.tokenizer_path={tmp_path / 'tok'}",
    )
    assert any("must share the student's tokenizer" in p for p in distill_gate_problems(cfg, check_files=True))


def test_teacher_settings_and_pool() -> None:
    text = _problems(*TEACHER, "algorithm.distillation.teacher.backend=gpu", "algorithm.distillation.kl_coef=0")
    assert "algorithm.distillation.teacher.backend='gpu' is unknown" in text
    assert "algorithm.distillation.kl_coef=0.0 must be > 0" in text
    assert "needs algorithm.distillation.teacher.path" in _problems("algorithm.distillation.enable=true")
    engine = compose_config(*TEACHER, "algorithm.distillation.teacher.backend=engine", "trainer.devices_per_node=4")
    assert reward_pool_devices(engine) == {"teacher": 1} and training_devices(engine) == 3
    hot = _problems(*TEACHER, "algorithm.distillation.teacher.backend=engine", "rollout.temperature=0.7")
    assert "algorithm.distillation.teacher.backend=engine scores with the raw logits" in hot
    layout = _problems(*TEACHER, "algorithm.distillation.teacher.megatron.tensor_model_parallel_size=3")
    assert "algorithm.distillation.teacher.megatron" in layout


def test_plan_shows_the_teacher_its_memory_and_where_it_runs() -> None:
    """A Megatron teacher is a row of the memory table (weights only, offloaded when colocated) and counts in the
    shared device's peak; an engine teacher a line on its pool."""
    on_megatron = compose_config(*TEACHER, "algorithm.distillation.teacher.offload=true")
    plan = build_plan(on_megatron)
    teacher = next(m for m in plan.memory if m.name == "teacher")
    actor = next(m for m in plan.memory if m.name == "actor")
    assert teacher.params == teacher.offloaded == actor.params and teacher.grads == teacher.optimizer == 0.0
    text = format_plan(plan)
    assert "params of the teacher, weights only" in text and "actor, ref, teacher and 8 embedded" in text
    assert "); Megatron on the training devices, TP=1 PP=1 DP=8, offloaded while the engines generate" in text
    without = build_plan(compose_config())
    assert plan.peaks["shared"].training - without.peaks["shared"].training == pytest.approx(teacher.params)
    engine = compose_config(*TEACHER, "algorithm.distillation.teacher.backend=engine", "trainer.devices_per_node=4")
    assert "1 embedded replica(s) of TP=1 on the teacher pool" in format_plan(build_plan(engine))
