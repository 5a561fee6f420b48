"""A reward model's engine pool on the command line: classification replicas start with SGLang's `--is-embedding`
(the embedded engine takes the same flag), a judge's without, and servers already running launch nothing."""

from pathlib import Path

from megarl.config.reward import RewardEnginesConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.embedded.__main__ import classifier_args, parse_args
from megarl.engines.replicas.launch import embedded_command, engine_load_format, sglang_base_args
from megarl.engines.replicas.reward_engines import launch_reward_engines, reward_engine_configs
from megarl.engines.replicas.sglang_command import LOOPBACK, SGLangServerArgs, sglang_command

KEYS = EngineKeys(api="k", admin="a")


def test_sglang_classification_flag() -> None:
    assert "--is-embedding" not in sglang_command(SGLangServerArgs(model_path="/rm"))
    command = sglang_command(SGLangServerArgs(model_path="/rm", is_embedding=True))
    flag = command.index("--is-embedding")
    assert command[flag + 1].startswith("--")  # store_true: no value
    engines = RewardEnginesConfig(engine="sglang", tensor_parallel_size=2, engine_kwargs={"chunked_prefill_size": 512})
    rollout, model = reward_engine_configs(engines, "/rm", "/rm_tok", random_init=False)
    args = sglang_base_args(rollout, model, LOOPBACK, KEYS, classify=True)
    assert args.is_embedding and args.tp_size == 2 and not args.enable_memory_saver
    assert args.extra == {"chunked_prefill_size": 512, "tokenizer_path": "/rm_tok"}
    assert not sglang_base_args(rollout, model, LOOPBACK, KEYS).is_embedding  # a judge generates


def test_reward_engine_configs() -> None:
    engines = RewardEnginesConfig(dtype="auto", mem_fraction_static=0.5, server_start_timeout_s=60.0)
    rollout, model = reward_engine_configs(engines, "/rm", None, random_init=True, model_dtype="float32")
    assert (rollout.engine, rollout.mem_fraction_static, rollout.server_start_timeout_s) == ("embedded", 0.5, 60.0)
    assert model.dtype == "float32" and engine_load_format(rollout, model) == "dummy"
    _, checkpoint = reward_engine_configs(engines, "/rm", None, random_init=False)
    assert checkpoint.dtype == "auto" and engine_load_format(rollout, checkpoint) == "auto"


def test_embedded_classification_command_parses() -> None:
    rollout, model = reward_engine_configs(RewardEnginesConfig(dtype="float32"), "/rm", "/rm_tok", random_init=False)
    command = embedded_command(rollout, model, LOOPBACK, 30001, "cpu", KEYS, classify=True)
    args = parse_args(command[3:])
    assert args.is_embedding and args.tokenizer_path == "/rm_tok" and args.api_key == "k"
    parsed = classifier_args(args)
    assert (parsed.model_path, parsed.tokenizer_path, parsed.dtype, parsed.device) == (
        "/rm",
        "/rm_tok",
        "float32",
        "cpu",
    )
    assert not parse_args(embedded_command(rollout, model, LOOPBACK, 30001, "cpu", KEYS)[3:]).is_embedding


def test_servers_already_running_launch_nothing(tmp_path: Path) -> None:
    engines = RewardEnginesConfig(urls=["http://10.0.0.5:30000", "http://10.0.0.6:30000"])
    pool = launch_reward_engines(
        engines, "/rm", None, classify=True, random_init=False,
        devices_per_node=8, device="cuda", log_dir=tmp_path, keys=KEYS,
    )  # fmt: skip
    assert pool.urls == engines.urls and pool.replicas == [] and pool.keys == EngineKeys()
    pool.stop()
