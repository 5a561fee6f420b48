"""Reward models in the plan: their pools in the device accounting and placement, the gate's errors, the plan's
lines and memory, and the shipped experiments `rm_qwen2_5_7b` and `judge_qwen2_5_7b`."""

import json
from pathlib import Path

import pytest
from conftest import compose_config

from megarl.assets import asset_path
from megarl.cli.plan import main as plan_main
from megarl.config import ConfigError
from megarl.plan.facts import reward_pool_devices, rollout_devices, training_devices
from megarl.plan.gate import validate
from megarl.plan.report import build_plan, format_plan
from megarl.workers import placement

QWEN_7B = "+experiment=qwen2_5_7b_tp4"
RM_7B = "reward_model.discriminative.path=" + str(asset_path("models/qwen2_5_7b_rm"))
JUDGE_7B = "reward_model.generative.path=" + str(asset_path("models/qwen2_5_7b"))
MEGATRON_RM = (QWEN_7B, "reward_model.discriminative.enable=true", RM_7B)
JUDGE = (QWEN_7B, "reward_model.generative.enable=true", JUDGE_7B, "reward_model.generative.engines.engine=sglang")
SEPARATE = ("trainer.nnodes=2", "trainer.placement=separate", "trainer.rollout_devices=4")


def _pools(*overrides: str) -> tuple[dict[str, int], int, int]:
    cfg = compose_config(*overrides)
    return reward_pool_devices(cfg), training_devices(cfg), rollout_devices(cfg)


def test_device_accounting() -> None:
    """Reward pools come out of the devices before the trainer's and the rollout's; none, nothing changes."""
    assert _pools(QWEN_7B) == ({}, 8, 8)
    assert _pools(QWEN_7B, *SEPARATE) == ({}, 12, 4)
    assert _pools(*MEGATRON_RM) == ({}, 8, 8)  # the Megatron RM shares the trainer's devices
    assert _pools(*JUDGE, "reward_model.generative.engines.devices=2") == ({"judge": 2}, 6, 6)
    server = ("reward_model.discriminative.backend=server", "reward_model.discriminative.engines.devices=2")
    assert _pools(*MEGATRON_RM, *server, *SEPARATE) == ({"classifier": 2}, 10, 4)
    both = _pools(*MEGATRON_RM, *server, *JUDGE[1:], *SEPARATE)
    assert both == ({"judge": 1, "classifier": 2}, 9, 4)
    assert _pools(*JUDGE, "reward_model.generative.engines.urls=[http://judge:30000]") == ({}, 8, 8)


def test_make_pools_adds_reward_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, int]] = []

    def create_pool(name: str, num_devices: int, *_: object) -> str:
        made.append((name, num_devices))
        return name

    monkeypatch.setattr(placement, "create_pool", create_pool)
    cfg = compose_config(*JUDGE, "reward_model.generative.engines.devices=2", *SEPARATE)
    assert list(placement.make_pools(cfg)) == ["train", "rollout", "judge"]
    assert made == [("train", 10), ("rollout", 4), ("judge", 2)]


def _problems(*overrides: str, check_files: bool = False) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(*overrides), check_files=check_files)
    return str(err.value)


def test_reward_models_validate_clean() -> None:
    validate(compose_config(*MEGATRON_RM), check_files=False)
    validate(compose_config(*JUDGE, "reward_model.generative.engines.devices=8", "trainer.nnodes=2"), check_files=False)
    no_config = (
        "reward_model.generative.enable=true",
        "reward_model.generative.path=/nowhere",
        "reward_model.generative.engines.urls=[http://j:1]",
    )
    validate(compose_config(QWEN_7B, *no_config), check_files=False)  # planning: a path not on this machine passes


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            (*JUDGE, "reward_model.generative.engines.devices=8"),
            "the reward pools (reward_model.generative.engines.devices=8) and trainer.rollout_devices=0 leave 0 of "
            "the 8 devices",
        ),
        (
            (*JUDGE, "reward_model.generative.engines.devices=2", *SEPARATE[1:], "trainer.rollout_devices=6"),
            "the reward pools (reward_model.generative.engines.devices=2) and trainer.rollout_devices=6 leave 0 of",
        ),
        (
            (
                *JUDGE,
                "reward_model.generative.engines.devices=3",
                "reward_model.generative.engines.tensor_parallel_size=2",
            ),
            "reward_model.generative.engines.devices=3 must be a positive multiple of "
            "reward_model.generative.engines.tensor_parallel_size=2",
        ),
        (
            (
                *JUDGE[:3],
                "reward_model.generative.engines.tensor_parallel_size=2",
                "reward_model.generative.engines.devices=2",
            ),
            "reward_model.generative.engines.engine=embedded runs one device per replica",
        ),
        (
            (
                *JUDGE,
                "reward_model.generative.engines.devices=3",
                "reward_model.generative.engines.tensor_parallel_size=3",
            ),
            "reward_model.generative.engines.tensor_parallel_size=3 must divide the model's 28 heads",
        ),
        (
            (*MEGATRON_RM, "reward_model.discriminative.megatron.tensor_model_parallel_size=3"),
            "reward_model.discriminative.megatron.tensor_model_parallel_size=3 must divide the model's 28 attention",
        ),
        (
            (
                *MEGATRON_RM,
                "reward_model.discriminative.megatron.tensor_model_parallel_size=4",
                "reward_model.discriminative.megatron.pipeline_model_parallel_size=4",
            ),
            "reward_model.discriminative.megatron: tp×pp×cp = 4×4×1 must divide the 8 training devices",
        ),
        (
            (
                *MEGATRON_RM[:2],
                "reward_model.discriminative.path=/nowhere",
                "reward_model.discriminative.megatron.pipeline_model_parallel_size=5",
            ),
            "reward_model.discriminative.megatron: tp×pp×cp = 1×5×1 must divide the 8 training",  # no config.json
        ),
        (
            (*MEGATRON_RM, "algorithm.filter_groups.enable=true"),
            "algorithm.filter_groups.enable with reward_model.discriminative.backend=megatron: dynamic sampling needs "
            "every score before training",
        ),
        (
            (
                "trainer=cpu",
                "reward_model.generative.enable=true",
                JUDGE_7B,
                "reward_model.generative.engines.engine=sglang",
            ),
            "reward_model.generative.engines.engine=sglang needs GPUs but trainer.device=cpu",
        ),
        (
            (*MEGATRON_RM[:2], "reward_model.discriminative.path=" + str(asset_path("models/qwen2_5_7b"))),
            "reward_model.discriminative.path: " + str(asset_path("models/qwen2_5_7b")) + "/config.json names "
            "architectures ['Qwen2ForCausalLM'], not a *ForSequenceClassification checkpoint",
        ),
    ],
)
def test_gate_errors(overrides: tuple[str, ...], message: str) -> None:
    assert message in _problems(*overrides)


def test_gate_rejects_many_labels(tmp_path: Path) -> None:
    hf = json.loads((asset_path("models/qwen2_5_7b_rm") / "config.json").read_text())
    hf["id2label"] = {"0": "bad", "1": "good"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    problems = _problems(*MEGATRON_RM[:2], f"reward_model.discriminative.path={tmp_path}")
    assert f"reward_model.discriminative.path: {tmp_path}/config.json has num_labels=2" in problems


def test_gate_rejects_unbuilt_family(tmp_path: Path) -> None:
    hf = json.loads((asset_path("models/qwen2_5_7b") / "config.json").read_text()) | {"hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    problems = _problems(QWEN_7B, "reward_model.generative.enable=true", f"reward_model.generative.path={tmp_path}")
    assert f"reward_model.generative.path: {tmp_path} is not a model family megarl builds" in problems


def test_gate_names_missing_paths_with_files() -> None:
    """With check_files a reward model's path must hold a config.json; without it a missing one passes (planning)."""
    overrides = (QWEN_7B, "reward_model.generative.enable=true", "reward_model.generative.path=/nowhere/judge")
    assert "reward_model.generative.path: /nowhere/judge/config.json does not exist" in _problems(
        *overrides, check_files=True
    )


def test_megatron_rm_memory_and_lines() -> None:
    """TP=4 on Qwen2.5-7B's shape with a 1-wide head, bf16, by hand: 28 layers of 2h norms + (QKV+bias, O, MLP) ÷ 4;
    the vocabulary (152064, a multiple of 128×4) ÷ 4; the value head and final norm."""
    h = 3584
    layer = 2 * h + ((h + 1) * (h + 2 * 512) + h * h + 3 * h * 18944) // 4
    shard = 28 * layer + 152064 * h // 4 + 2 * h
    cfg = compose_config(*MEGATRON_RM, "reward_model.discriminative.megatron.tensor_model_parallel_size=4")
    plan = build_plan(cfg)
    rm = next(m for m in plan.memory if m.name == "rm")
    assert rm.params == rm.offloaded == shard * 2
    text = format_plan(plan)
    assert "actor, ref, rm and 4 sglang replica(s)" in text
    assert "(7.07B params); Megatron on the training devices, TP=4 PP=1 DP=2, offloaded" in text
    assert f"({shard / 1e9:.2f}B params of the reward model, weights only)" in text


def test_offload_off_keeps_rm_on_device() -> None:
    on = build_plan(compose_config(*MEGATRON_RM))
    off = build_plan(compose_config(*MEGATRON_RM, "reward_model.discriminative.offload=false"))
    rm = next(m for m in on.memory if m.name == "rm")
    assert off.peaks["shared"].rollout - on.peaks["shared"].rollout == pytest.approx(rm.params)
    assert off.peaks["shared"].training == on.peaks["shared"].training


def test_plan_lines_name_pools() -> None:
    server = ("reward_model.discriminative.backend=server", "reward_model.discriminative.engines.devices=2")
    cfg = compose_config(*MEGATRON_RM, *server, *JUDGE[1:], "reward_model.generative.engines.devices=2", *SEPARATE)
    text = format_plan(build_plan(cfg))
    assert "judge: 2 device(s), node 1 device 4 .. node 1 device 5: 2 sglang replica(s)" in text
    assert "classifier: 2 device(s), node 1 device 6 .. node 1 device 7: 2 embedded replica(s)" in text
    assert "(7.62B params); 2 sglang replica(s) of TP=1 on the judge pool" in text
    assert "(7.07B params); 2 embedded replica(s) of TP=1 on the classifier pool" in text
    remote = format_plan(build_plan(compose_config(QWEN_7B, "reward_model.remote.url=http://rm:8000/score")))
    assert "remote     http://rm:8000/score (reward_model.remote.url): no devices" in remote


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        plan_main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.mark.parametrize(
    ("experiment", "line"),
    [
        ("rm_qwen2_5_7b", "rm         "),
        ("judge_qwen2_5_7b", "           judge: 4 device(s), node 1 device 4 .. node 1 device 7: 2 sglang replica(s)"),
    ],
)
def test_shipped_reward_experiments_fit(capsys: pytest.CaptureFixture[str], experiment: str, line: str) -> None:
    code, out, err = _plan(capsys, f"+experiment={experiment}")
    assert code == 0, out + err
    assert "verdict    fits" in out and line in out


def test_gate_names_an_unreachable_service_and_the_judges_tokens_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With check_files the gate asks the judge's tokenizer and the service itself (scoring's start-up checks)."""
    monkeypatch.delenv("MEGARL_NO_SUCH_TOKEN", raising=False)
    remote = ("reward_model.remote.url=http://127.0.0.1:1/score", "reward_model.remote.auth_env=MEGARL_NO_SUCH_TOKEN")
    judge = ("reward_model.generative.enable=true", f"reward_model.generative.path={asset_path('models/qwen2_5_7b')}")
    tokens = (
        f"reward_model.generative.tokenizer_path={asset_path('tokenizer')}",
        "reward_model.generative.parser=yes_no",
    )
    problems = _problems(QWEN_7B, *remote, *judge, *tokens, check_files=True)
    assert "http://127.0.0.1:1/score" in problems and "MEGARL_NO_SUCH_TOKEN" in problems
    assert "single token" in problems  # the shipped tokenizer splits "Yes" / "No"
