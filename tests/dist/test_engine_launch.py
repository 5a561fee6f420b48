"""Rollout replicas from the config: SGLang command lines per node, and embedded replicas started on Ray."""

import socket
import sys
from pathlib import Path

import pytest
import ray
from cases.engine_cases import engine_client, run, save_engine_model
from conftest import compose_config

from megarl.config import ConfigError
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import EngineError
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.replicas.launch import engine_layout, launch_engines, sglang_base_args
from megarl.engines.replicas.replica import EngineNodeActor, PortLedger, ReplicaHandle
from megarl.engines.replicas.sglang_command import replica_node_args, sglang_command
from megarl.plan.gate import validate

KEYS = EngineKeys(api="api-k", admin="admin-k")


def test_sglang_command_lines_from_config_overrides() -> None:
    cfg = compose_config(
        "rollout=sglang",
        "model.path=/ckpt/hf",
        "model.max_model_len=4096",
        "rollout.tensor_parallel_size=16",
        "rollout.expert_parallel_size=8",
        "rollout.load_format=dummy",
        "rollout.enable_cuda_graph=false",
        "rollout.attention_backend=fa3",
        "rollout.dtype=bfloat16",
        "+rollout.engine_kwargs.chunked_prefill_size=8192",
    )
    layout = engine_layout(cfg.rollout, num_devices=32, devices_per_node=8)
    assert (layout.num_replicas, layout.nodes_per_replica) == (2, 2)
    per_node = replica_node_args(
        sglang_base_args(cfg.rollout, cfg.model, "0.0.0.0", KEYS), layout, 1, ["10.0.0.3", "10.0.0.4"], 30000, 20000
    )
    node1 = sglang_command(per_node[1])
    assert node1[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = {tok: nxt for tok, nxt in zip(node1[3:], [*node1[4:], "--"], strict=True) if not nxt.startswith("--")}
    expected = {
        "--model-path": "/ckpt/hf",
        "--tp-size": "16",
        "--ep-size": "8",
        "--nnodes": "2",
        "--node-rank": "1",
        "--dist-init-addr": "10.0.0.3:20000",
        "--load-format": "dummy",
        "--attention-backend": "fa3",
        "--dtype": "bfloat16",
        "--context-length": "4096",
        "--mem-fraction-static": "0.6",
        "--chunked-prefill-size": "8192",
    }
    assert {k: flags.get(k) for k in expected} == expected
    assert "--disable-cuda-graph" in node1 and "--enable-memory-saver" in node1
    assert "--enable-weights-cpu-backup" not in node1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.tensor_parallel_size=2"], "rollout.engine=embedded runs one device per replica"),
        (["rollout.data_parallel_size=3"], "must divide the 2 rollout devices"),
        (["rollout.load_format=pt"], "rollout.load_format"),
    ],
)
def test_bad_rollout_layouts_are_named(overrides: list[str], message: str, data_overrides: list[str]) -> None:
    cfg = compose_config("model=tiny_dense", *data_overrides, *overrides, config_name="demo_cpu")
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_expert_parallel_must_divide_tp(data_overrides: list[str]) -> None:
    cfg = compose_config(
        "model=tiny_dense",
        *data_overrides,
        "rollout.engine=sglang",
        "trainer.device=cuda",
        "rollout.tensor_parallel_size=2",
        "rollout.expert_parallel_size=4",
        config_name="demo_cpu",
    )
    with pytest.raises(ConfigError, match="rollout.expert_parallel_size=4 must divide"):
        validate(cfg)


@pytest.mark.usefixtures("local_ray")
def test_embedded_replicas_launch_on_ray_and_serve_through_the_router(tmp_path: Path) -> None:
    model = save_engine_model(tmp_path / "model", hidden=64, layers=2)
    cfg = compose_config(
        f"model.path={model}",
        "model.random_init=false",
        "model.dtype=float32",
        "rollout.max_running_requests=8",
        "rollout.request_timeout_s=60",
    )
    rollout = cfg.rollout
    keys = EngineKeys.generate()
    fleet = launch_engines(
        rollout, cfg.model, num_devices=2, devices_per_node=2, device="cpu", log_dir=tmp_path / "logs", keys=keys
    )
    try:
        assert len(fleet.urls) == 2 and fleet.keys is keys

        async def scenario() -> tuple[list[int], str]:
            router = Router.from_config(rollout, fleet.urls, fleet.keys)
            assert router.replicas[0].client.timeouts.generate_s == 60
            results = await router.generate([1, 2, 3], SamplingParams(max_new_tokens=4, n=2, ignore_eos=True))
            await router.abort(abort_all=True)  # /abort_request takes only the admin key: the clients send it there
            await router.close()
            anonymous = engine_client(fleet.urls[0])
            with pytest.raises(EngineError, match="HTTP 401") as refused:
                await anonymous.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
            await anonymous.close()
            return [len(r.output_ids) for r in results], str(refused.value)

        lengths, refused = run(scenario())
        assert lengths == [4, 4] and "Unauthorized" in refused
        logs = [(tmp_path / "logs" / f"replica{r}" / "node0.log").read_text() for r in range(2)]
        assert all(logs) and not any(key in log for log in logs for key in keys.values())
    finally:
        fleet.stop()


def test_a_port_bound_on_a_node_is_not_free_there() -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert EngineNodeActor().ports_free([port]) is False
        assert port not in EngineNodeActor().free_ports(8, exclude=[])
    assert EngineNodeActor().ports_free([port]) is True


@pytest.mark.usefixtures("local_ray")
def test_replicas_sharing_a_node_never_get_the_same_port() -> None:
    ledger = PortLedger()
    replicas = [ReplicaHandle.create(2, num_cpus=0.1) for _ in range(3)]  # two "nodes" each, on this machine
    try:
        picked = [replica.reserve_ports(3, ledger) for replica in replicas]
    finally:
        for replica in replicas:
            replica.stop()
    ports = [p for group in picked for p in group]
    assert len(set(ports)) == 9
    assert ledger.taken([str(ray.util.get_node_ip_address())]) == set(ports)
