"""Config composition, the frozen key surface, and every validation rule."""

import dataclasses
import json
import os
import types
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cases.cli_cases import megarl_train
from conftest import compose_config
from omegaconf import DictConfig, OmegaConf

from megarl.cli import moved_key_problems
from megarl.config import ConfigError, MegarlConfig, to_config
from megarl.config.layout import ModelFacts, check_layout, stage_layers
from megarl.config.sync import SyncConfig, trainer_env
from megarl.config.training import MegatronConfig
from megarl.plan.facts import batch_sizes
from megarl.plan.gate import validate

SNAPSHOT = Path(__file__).parent / "snapshots" / "config_keys.txt"


def _type_name(tp: object) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def config_keys(cls: type = MegarlConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config with its type, nested dataclasses expanded."""
    lines = []
    for field in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[field.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] if isinstance(tp, types.UnionType) else [tp]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            lines += config_keys(typing.cast(type, args[0]), f"{prefix}{field.name}.")
        else:
            lines.append(f"{prefix}{field.name}: {_type_name(tp)}")
    return lines


def test_config_key_snapshot() -> None:
    keys = "\n".join(config_keys()) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(keys)
    assert keys == SNAPSHOT.read_text(), (
        "the set of config keys changed; if deliberate, run "
        "`UPDATE_SNAPSHOTS=1 pytest tests/unit/config/test_config.py` "
        "and commit tests/unit/config/snapshots/config_keys.txt"
    )


@pytest.mark.parametrize(
    ("config_name", "overrides"),
    [
        ("ppo", []),
        ("ppo", ["model=tiny_moe"]),
        ("ppo", ["algorithm=ppo"]),
        ("ppo", ["algorithm=dapo", "rollout=sglang"]),
        ("ppo", ["algorithm=dr_grpo"]),
        ("ppo", ["algorithm=gspo"]),
        ("demo_cpu", ["model=tiny_dense", "algorithm=dapo", "algorithm.overlong_buffer.len=4"]),
        ("ppo", ["+experiment=tiny_moe_ep2"]),
        ("ppo", ["+experiment=gsm8k_tools"]),
        ("demo_cpu", ["model=tiny_dense"]),
        (
            "demo_cpu",
            [
                "model=tiny_dense",
                "trainer.placement=separate",
                "trainer.rollout_devices=1",
                "actor.megatron.tensor_model_parallel_size=1",
            ],
        ),
    ],
)
def test_shipped_configs_validate(config_name: str, overrides: list[str], data_overrides: list[str]) -> None:
    cfg = compose_config(*overrides, *data_overrides, config_name=config_name)
    validate(cfg)


def test_composition_and_overrides(data_overrides: list[str]) -> None:
    cfg = compose_config("+experiment=tiny_moe_ep2", "actor.optim.lr=3e-6", *data_overrides)
    assert cfg.model.path.endswith("models/tiny_moe") and Path(cfg.model.path, "config.json").is_file()
    assert cfg.actor.megatron.expert_model_parallel_size == 2
    assert cfg.actor.optim.lr == 3e-6
    assert cfg.trainer.device == "cpu"
    assert cfg.ref.megatron is None
    assert cfg.trainer.run_dir == "runs/megarl/tiny_moe_ep2"


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(Exception, match="actor.ppo_mini_batchsize"):
        compose_config("actor.ppo_mini_batchsize=4")


def test_batch_algebra(data_overrides: list[str]) -> None:
    cfg = compose_config(
        "data.train_batch_size=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_device=2",
        "actor.megatron.tensor_model_parallel_size=2",
        *data_overrides,
    )
    validate(cfg)
    sizes = batch_sizes(cfg, "actor")
    assert (sizes.trajectories_per_step, sizes.mini_batches_per_step, sizes.trajectories_per_mini_batch) == (64, 2, 32)
    assert (sizes.dp, sizes.trajectories_per_device, sizes.micro_batches) == (4, 8, 4)


def _problems(*overrides: str, data: list[str]) -> str:
    cfg = compose_config(*data, *overrides)
    with pytest.raises(ValueError) as info:
        validate(cfg)
    assert isinstance(info.value, ConfigError)
    return str(info.value)


def test_indivisible_mini_batch_names_the_fields(data_overrides: list[str]) -> None:
    msg = _problems("data.train_batch_size=3", "rollout.n=5", "actor.ppo_mini_batch_size=4", data=data_overrides)
    for name in ("data.train_batch_size=3", "rollout.n=5", "actor.ppo_mini_batch_size=4", "[1, 3]"):
        assert name in msg


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor.megatron.tensor_model_parallel_size=3"], "actor.megatron.tensor_model_parallel_size=3 must divide"),
        (["actor.megatron.pipeline_model_parallel_size=4"], "must divide the model's 2 layers"),
        (
            ["actor.megatron.num_layers_in_first_pipeline_stage=1"],
            "actor.megatron.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage split layers over "
            "pipeline stages: set them to null with pipeline_model_parallel_size=1",
        ),
        (
            ["actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.num_layers_in_last_pipeline_stage=2"],
            "the other 1 stage(s) get the model's 2 layers less 2 = 0, which must be split evenly, at least one",
        ),
        (
            ["actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.num_layers_in_first_pipeline_stage=0"],
            "actor.megatron.num_layers_in_first_pipeline_stage=0 must be >= 1",
        ),
        (["actor.megatron.expert_model_parallel_size=2"], "needs a MoE model"),
        (
            ["actor.megatron.context_parallel_size=2", "actor.megatron.sequence_packing=false"],
            "actor.megatron.context_parallel_size=2 splits packed sequences over CP ranks: set actor.megatron.seq",
        ),
        (
            ["algorithm=ppo", "critic.megatron.context_parallel_size=2", "critic.megatron.sequence_packing=false"],
            "critic.megatron.context_parallel_size=2 splits",
        ),
        (["model=tiny_moe", "actor.megatron.expert_model_parallel_size=3"], "must divide the model's 4 experts"),
        (["model=tiny_moe", "actor.megatron.tensor_model_parallel_size=2"], "sequence_parallel must be true"),
        (["trainer.devices_per_node=3", "actor.megatron.tensor_model_parallel_size=2"], "must divide the 3 training"),
        (["model.max_model_len=300"], "exceeds the model's context of 300"),
        (["algorithm.adv_estimator=nope"], "algorithm.adv_estimator='nope' is unknown"),
        (["algorithm.adv_estimator=no_such_pkg.mod:fn"], "cannot import"),
        (["algorithm.loss_agg_mode=sum"], "algorithm.loss_agg_mode='sum' is unknown"),
        (["trainer.logger=[console,mlflow]"], "trainer.logger='mlflow' is unknown"),
        (["rollout.n=1"], "set rollout.n >= 2"),
        (["trainer.device=cpu", "trainer.devices_per_node=2"], "rollout.engine=sglang needs GPUs"),
        (["data.train_files=[/nonexistent/train.parquet]"], "data.train_files: /nonexistent/train.parquet does not"),
        (["model.random_init=false"], "no *.safetensors"),
        (["trainer.resume_mode=/nonexistent/ckpt"], "trainer.resume_mode='/nonexistent/ckpt'"),
        (["trainer.resume_mode=/"], "a global_step_<k> directory with trainer_state.pt"),
        (["trainer.placement=separate"], "trainer.placement=separate needs 0 < trainer.rollout_devices < the 8"),
        (["trainer.placement=separate", "trainer.rollout_devices=8"], "got 8: set trainer.rollout_devices to"),
        (
            ["trainer.rollout_devices=2"],
            "trainer.rollout_devices=2 sizes the rollout pool of trainer.placement=separate",
        ),
        (
            ["trainer.placement=separate", "trainer.rollout_devices=5", "actor.megatron.tensor_model_parallel_size=2"],
            "must divide the 3 training devices",
        ),
        (
            [
                "trainer.placement=separate",
                "trainer.rollout_devices=3",
                "rollout=sglang",
                "rollout.tensor_parallel_size=2",
            ],
            "= 2×1×1 must divide the 3 rollout devices",
        ),
        (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size=3 must divide"),
        (["actor.ppo_micro_batch_size_per_device=3"], "actor.ppo_micro_batch_size_per_device=3 must divide"),
        (["data.train_batch_size=6", "actor.ppo_mini_batch_size=1", "rollout.n=3"], "data-parallel ranks"),
        (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_device=100"], "below one full trajectory"),
        (["algorithm=ppo", "critic.ppo_mini_batch_size=5"], "critic.ppo_mini_batch_size=5"),
        (["rollout.top_p=0"], "rollout.top_p=0.0 must be in (0, 1]"),
        (["algorithm.clip_ratio_c=1"], "algorithm.clip_ratio_c=1.0 must be > 1"),
        (["algorithm.clip_ratio_low=1.5"], "algorithm.clip_ratio_low=1.5 must be in [0, 1)"),
        (["algorithm.lam=2"], "algorithm.lam=2.0 must be in [0, 1]"),
        (["algorithm.rollout_is_cap=0"], "algorithm.rollout_is_cap=0.0 must be > 0"),
        (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "kl_ctrl.target_kl > 0"),
        (["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=999"], "overlong_buffer.len=999"),
        (["algorithm.policy_loss=clip"], "algorithm.policy_loss='clip' is unknown"),
        (
            ["algorithm.kl_loss_type=k4"],
            "choose one of abs, abs+, k1, k1+, k2, k3, k3+, kl, kl+, low_var_kl, low_var_kl+, mse",
        ),
        (["algorithm.adv_estimator=gdpo"], "adv_estimator=gdpo combines several rewards: set algorithm.reward_weights"),
        (["+algorithm.reward_weights.acc=1.0"], "reward_weights is read only by gdpo, not algorithm.adv_estimator"),
        (["algorithm.policy_loss=dro"], "policy_loss=dro needs algorithm.loss_params.dro_beta > 0 (got None)"),
        (["algorithm.policy_loss=bypass", "algorithm.rollout_is_cap=2"], "set algorithm.rollout_is_cap=null"),
        (["algorithm.rollout_is_cap=2", "algorithm.rollout_correction.level=token"], "algorithm.rollout_is_cap"),
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], "adv_estimator=rloo compares samples"),
        (["actor.optim.name=lion"], "actor.optim.name='lion' is unknown; choose one of adam, sgd"),
        (["critic.optim.name=sgd"], "set critic.megatron.use_distributed_optimizer=false"),
        (["sync.transport=nvlink"], "sync.transport='nvlink' is unknown; choose one of auto, tensor, broadcast"),
        (["sync.bucket_bytes=1000"], "sync.bucket_bytes=1000 must be >= 1 MiB"),
        (["trainer.device=cpu", "sync.backend=nccl"], "sync.backend=nccl needs GPUs"),
        (["sync.transport=broadcast", "rollout.pipeline_parallel_size=2"], "set rollout.pipeline_parallel_size=1"),
        (["sync.transport=broadcast"], "one NCCL group on the same GPU, which NCCL refuses"),
        (["rollout=sglang", "rollout.data_parallel_size=2"], "rollout.data_parallel_size=2: SGLang 0.5.23 takes"),
        (["sync.tensor_format=pickle"], "sync.tensor_format='pickle' is unknown"),
        (["data.val_files=[1]"], "data.val_files=[1] must be a parquet path or a list of them"),
        (["critic.megatron.transformer_impl=te"], "critic.megatron.transformer_impl='te' is unknown"),
        (
            ["trainer.device=cpu", "actor.megatron.transformer_impl=transformer_engine"],
            "actor.megatron.transformer_impl=transformer_engine needs GPUs but trainer.device=cpu",
        ),
    ],
)
def test_validation_errors(overrides: list[str], expected: str, data_overrides: list[str]) -> None:
    if any(o.startswith("trainer.device=cpu") for o in overrides):
        overrides = [*overrides, "rollout=sglang"]
    assert expected in _problems(*overrides, data=data_overrides)


def test_colocated_broadcast_over_gloo_is_accepted(data_overrides: list[str]) -> None:
    validate(compose_config("sync.transport=broadcast", "sync.backend=gloo", *data_overrides))


def test_all_problems_reported_at_once(data_overrides: list[str]) -> None:
    msg = _problems("rollout.n=0", "algorithm.kl_penalty=k9", "data.truncation=top", data=data_overrides)
    assert "3 problems" in msg
    assert "rollout.n=0 must be >= 1" in msg and "algorithm.kl_penalty" in msg and "data.truncation" in msg


def test_dynamic_bsz_needs_no_dp_divisibility(data_overrides: list[str]) -> None:
    cfg = compose_config(
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=1",
        "rollout.n=3",
        "actor.use_dynamic_bsz=true",
        *data_overrides,
    )
    validate(cfg)


def test_trainer_driver_and_dynamic_sampling_metric_are_checked(data_overrides: list[str]) -> None:
    text = _problems(
        "trainer.driver=replay",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        data=data_overrides,
    )
    assert (
        "trainer.driver='replay' is unknown; choose one of sync, one_step_off, fully_async, rollout_only, train_only"
        in text
    )
    assert "algorithm.filter_groups.metric='acc'" in text


def test_single_data_path_is_a_one_element_list(small_parquet: dict[str, Path]) -> None:
    path = str(small_parquet["plain"])
    cfg = compose_config(f"data.train_files={path}", f"data.val_files={path}")
    assert cfg.data.train_files == [path] and cfg.data.val_files == [path]
    validate(cfg)
    yaml = OmegaConf.create({"model": {"path": "m"}, "data": {"train_files": path, "val_files": None}})
    assert isinstance(yaml, DictConfig)
    assert to_config(yaml).data.train_files == [path] and to_config(yaml).data.val_files == []


Rows = list[dict[str, typing.Any]]


def _rewrite(source: Path, target: Path, change: typing.Callable[[Rows], Rows]) -> Path:
    """`target`: the rows of `source` after `change`, as parquet."""
    table = pq.read_table(source)
    rows = change(table.to_pylist())
    pq.write_table(pa.Table.from_pylist(rows) if rows else table.schema.empty_table(), target)
    return target


def _no_ground_truth(rows: Rows) -> Rows:
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    return rows


BAD_DATA = {
    "string_prompt": (
        lambda rows: [dict(r, prompt=r["prompt"][-1]["content"]) for r in rows],
        "row 0 column 'prompt': prompt must be chat messages [{'role': 'user', 'content': ...}], got a string; "
        "wrap it or re-run megarl-preprocess (and 39 more of the first 40 rows)",
    ),
    "missing_column": (
        lambda rows: [{k: v for k, v in r.items() if k != "reward_model"} for r in rows],
        "has no column 'reward_model' (it has ['data_source', 'prompt', 'ability', 'extra_info']); re-run "
        "megarl-preprocess",
    ),
    "missing_prompt_column": (
        lambda rows: [{"messages" if k == "prompt" else k: v for k, v in r.items()} for r in rows],
        "has no column 'prompt' (it has ['data_source', 'messages', 'ability', 'reward_model', 'extra_info']); "
        "set data.prompt_key",
    ),
    "no_ground_truth": (_no_ground_truth, "row 2 column 'reward_model': reward_model.ground_truth is missing"),
    "extra_info_not_a_dict": (
        lambda rows: [dict(r, extra_info=json.dumps(r["extra_info"])) for r in rows],
        "row 0 column 'extra_info': extra_info must be a mapping (a parquet struct), got str",
    ),
    "no_rows": (lambda rows: [], "has no rows; re-run megarl-preprocess"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_is_named_by_validate(
    case: str, small_parquet: dict[str, Path], data_overrides: list[str], tmp_path: Path
) -> None:
    change, expected = BAD_DATA[case]
    bad = _rewrite(small_parquet["plain"], tmp_path / "bad.parquet", change)
    msg = _problems(f"data.val_files={bad}", data=data_overrides)
    assert "invalid config (1 problem)" in msg
    assert f"data.val_files: {bad} {expected}" in msg, msg


def test_corrupt_parquet_is_named_by_validate(data_overrides: list[str], tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"not parquet at all")
    msg = _problems(f"data.train_files={bad}", "rollout.n=0", data=data_overrides)
    assert "invalid config (2 problems)" in msg and "rollout.n=0 must be >= 1" in msg
    assert f"data.train_files: {bad} is not a readable parquet file (Parquet magic bytes not found" in msg
    assert "re-run megarl-preprocess" in msg


def test_cli_names_a_string_prompt_before_starting_ray(small_parquet: dict[str, Path], tmp_path: Path) -> None:
    bad = _rewrite(small_parquet["plain"], tmp_path / "strings.parquet", BAD_DATA["string_prompt"][0])
    out = megarl_train(
        f"data.train_files={bad}", f"data.val_files={small_parquet['plain']}", f"trainer.run_dir={tmp_path}"
    )
    assert out.returncode == 2, out.stderr
    assert f"data.train_files: {bad} row 0 column 'prompt': prompt must be chat messages" in out.stderr
    assert "wrap it or re-run megarl-preprocess" in out.stderr
    assert "Traceback" not in out.stderr and "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "config.yaml").exists()


def test_trainer_workers_join_sglangs_nccl_cumem_setting_only_on_an_nccl_broadcast_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert trainer_env(SyncConfig(), "separate", "cuda") == {"NCCL_CUMEM_ENABLE": "0"}
    assert trainer_env(SyncConfig(), "colocated", "cuda") == {}
    assert trainer_env(SyncConfig(backend="gloo"), "separate", "cuda") == {}
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert trainer_env(SyncConfig(), "separate", "cuda") == {"NCCL_CUMEM_ENABLE": "1"}


def test_moved_keys_are_named_with_their_new_key() -> None:
    assert moved_key_problems(["trainer.driver=sync", "+trainer.mode=train", "rollout.n=2"]) == [
        "trainer.mode was replaced by trainer.driver (train is now sync; rollout_only and train_only keep their names)"
    ]
    assert moved_key_problems(["async_training.max_staleness=1", "--cfg", "job"]) == []
    assert moved_key_problems(["trainer.mode=sft", "trainer.mode=rl"]) == []  # the key's new values


def test_uneven_pipeline_stages_fit_deepseek_v3_and_split_as_megatron_does() -> None:
    """DeepSeek-V3's 61 layers at PP8: 5 on the first stage, 8 on the others (megatron's `get_num_layers_to_build`);
    with virtual stages each stage holds one chunk per round (`get_transformer_layer_offset`)."""
    facts = ModelFacts(num_layers=61, num_heads=128, num_kv_heads=128, num_experts=256, max_position_embeddings=0)
    mp = MegatronConfig(
        pipeline_model_parallel_size=8, num_layers_in_first_pipeline_stage=5, num_layers_in_last_pipeline_stage=8
    )
    assert check_layout("actor.megatron", mp, facts, num_devices=64) == []
    assert [len(layers) for layers in stage_layers(mp, 61)] == [5, 8, 8, 8, 8, 8, 8, 8]
    interleaved = MegatronConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2
    )
    assert stage_layers(interleaved, 8) == [[0, 4], [1, 2, 3, 5, 6, 7]]
