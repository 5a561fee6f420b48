"""SGLang command lines and replica layouts, checked against the flags SGLang 0.5.23 accepts."""

import sys

import pytest

from megarl.config.lora import LoraConfig
from megarl.engines.replicas.launch import LoraServing, lora_serving
from megarl.engines.replicas.sglang_command import (
    ReplicaLayout,
    SGLangServerArgs,
    health_url,
    replica_layout,
    replica_node_args,
    server_url,
    sglang_command,
)

PY = sys.executable
LAUNCH = [PY, "-m", "sglang.launch_server"]

# Flags of `python -m sglang.launch_server` in sglang 0.5.23 that megarl may emit, transcribed from
# /work/shared/SGLANG_PROTOCOL.md (§5 Launcher, plus flags named in §1-§4): flag → takes a value.
SGLANG_0_5_23_FLAGS = {
    "--model-path": True,
    "--tokenizer-path": True,
    "--dtype": True,
    "--trust-remote-code": False,
    "--context-length": True,
    "--load-format": True,
    "--skip-tokenizer-init": False,
    "--host": True,
    "--port": True,
    "--api-key": True,
    "--admin-api-key": True,
    "--tp-size": True,
    "--dp-size": True,
    "--pp-size": True,
    "--ep-size": True,
    "--nnodes": True,
    "--node-rank": True,
    "--dist-init-addr": True,
    "--mem-fraction-static": True,
    "--enable-memory-saver": False,
    "--enable-weights-cpu-backup": False,
    "--attention-backend": True,
    "--base-gpu-id": True,
    "--gpu-id-step": True,
    "--max-running-requests": True,
    "--log-level": True,
    "--disable-cuda-graph": False,
    "--enable-return-routed-experts": False,
    "--enable-lora": False,
    "--max-lora-rank": True,
    "--lora-target-modules": True,
    "--incremental-streaming-output": False,
    "--preferred-sampling-params": True,
    "--enable-deterministic-inference": False,
    "--allow-auto-truncate": False,
    "--custom-weight-loader": True,
}


def assert_known_flags(command: list[str]) -> None:
    """Every flag is one SGLang 0.5.23 accepts, with a value exactly when the flag takes one."""
    assert command[:3] == LAUNCH
    args = command[3:]
    for i, token in enumerate(args):
        if not token.startswith("--"):
            continue
        assert token in SGLANG_0_5_23_FLAGS, f"{token} is not a known sglang 0.5.23 flag"
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        assert has_value == SGLANG_0_5_23_FLAGS[token], f"{token}: value given = {has_value}"


def test_single_node_tp2_replica() -> None:
    layout = replica_layout(num_devices=4, devices_per_node=8, tp=2, dp=1, pp=1)
    base = SGLangServerArgs(model_path="/models/qwen", tp_size=2)
    (args,) = replica_node_args(base, layout, 1, ["10.0.0.5"], port=30001, dist_port=20001)
    command = sglang_command(args)
    assert command == [
        *LAUNCH,
        "--model-path", "/models/qwen",
        "--dtype", "auto",
        "--load-format", "auto",
        "--host", "127.0.0.1",
        "--port", "30001",
        "--tp-size", "2",
        "--dp-size", "1",
        "--pp-size", "1",
        "--ep-size", "1",
        "--nnodes", "1",
        "--node-rank", "0",
        "--dist-init-addr", "10.0.0.5:20001",
        "--base-gpu-id", "2",  # replica 1 takes the node's devices 2 and 3
        "--log-level", "info",
    ]  # fmt: skip
    assert_known_flags(command)
    assert health_url(args, "10.0.0.5") == "http://127.0.0.1:30001/health_generate"


def test_two_node_tp16_replica() -> None:
    layout = replica_layout(num_devices=16, devices_per_node=8, tp=16, dp=1, pp=1)
    base = SGLangServerArgs(model_path="/models/big", tp_size=16, mem_fraction_static=0.7)
    node0, node1 = replica_node_args(base, layout, 0, ["10.0.0.1", "10.0.0.2"], port=30000, dist_port=20000)
    common = ["--model-path", "/models/big", "--dtype", "auto", "--load-format", "auto"]
    parallel = ["--tp-size", "16", "--dp-size", "1", "--pp-size", "1", "--ep-size", "1", "--nnodes", "2"]
    tail = ["--dist-init-addr", "10.0.0.1:20000", "--mem-fraction-static", "0.7", "--base-gpu-id", "0"]
    for rank, args in enumerate((node0, node1)):
        command = sglang_command(args)
        assert command == [
            *LAUNCH, *common, "--host", "0.0.0.0", "--port", "30000", *parallel,
            "--node-rank", str(rank), *tail, "--log-level", "info",
        ]  # fmt: skip
        assert_known_flags(command)
    # node 0 binds every interface, so the API is reached at its routable address
    assert server_url(node0, "10.0.0.1") == "http://10.0.0.1:30000"
    assert health_url(node0, "10.0.0.1") == "http://10.0.0.1:30000/health_generate"


def test_configured_host_is_kept() -> None:
    layout = replica_layout(16, 8, tp=16)
    base = SGLangServerArgs(model_path="/m", tp_size=16, host="10.0.0.1")
    assert [a.host for a in replica_node_args(base, layout, 0, ["10.0.0.1", "10.0.0.2"], 1, 2)] == ["10.0.0.1"] * 2
    exposed = SGLangServerArgs(model_path="/m", host="0.0.0.0")
    (single,) = replica_node_args(exposed, replica_layout(1, 1, tp=1), 0, ["10.0.0.9"], 1, 2)
    assert single.host == "0.0.0.0" and server_url(single, "10.0.0.9") == "http://10.0.0.9:1"


def test_colocated_options_and_extra_pass_through() -> None:
    args = SGLangServerArgs(
        model_path="/m",
        load_format="dummy",
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        disable_cuda_graph=True,
        attention_backend="fa3",
        dtype="bfloat16",
        context_length=4096,
        trust_remote_code=True,
        skip_tokenizer_init=True,
        api_key="secret",
        admin_api_key="admin-secret",
        max_running_requests=64,
        enable_return_routed_experts=True,
        enable_deterministic_inference=True,
        extra={
            "incremental_streaming_output": True,
            "allow-auto-truncate": False,
            "chat_template": None,
            "custom_weight_loader": ["pkg.mod.load_a", "pkg.mod.load_b"],
            "--preferred-sampling-params": {"temperature": 0.5},
            "gpu_id_step": 2,
        },
    )
    command = sglang_command(args, python="python3")
    assert command == [
        "python3", "-m", "sglang.launch_server",
        "--model-path", "/m",
        "--dtype", "bfloat16",
        "--load-format", "dummy",
        "--context-length", "4096",
        "--trust-remote-code",
        "--skip-tokenizer-init",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--api-key", "secret",
        "--admin-api-key", "admin-secret",
        "--tp-size", "1",
        "--dp-size", "1",
        "--pp-size", "1",
        "--ep-size", "1",
        "--nnodes", "1",
        "--node-rank", "0",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--attention-backend", "fa3",
        "--disable-cuda-graph",
        "--enable-deterministic-inference",
        "--base-gpu-id", "0",
        "--max-running-requests", "64",
        "--enable-return-routed-experts",
        "--log-level", "info",
        "--incremental-streaming-output",
        "--custom-weight-loader", "pkg.mod.load_a", "pkg.mod.load_b",
        "--preferred-sampling-params", '{"temperature": 0.5}',
        "--gpu-id-step", "2",
    ]  # fmt: skip
    assert_known_flags([*LAUNCH, *command[3:]])


def test_lora_serving_flags() -> None:
    """`actor.lora` with sync=adapter asks the engines for LoRA serving; SGLang and the embedded engine get the same
    flags (PEFT's all-linear as their `all`); a target SGLang 0.5.23 does not take (Mixtral's expert w1) is refused."""
    assert lora_serving(LoraConfig(rank=8)) == LoraServing(max_rank=8, target_modules=("all-linear",))
    assert lora_serving(LoraConfig(rank=8, sync="merged")) is None and lora_serving(LoraConfig()) is None
    lora = LoraServing(max_rank=16, target_modules=("q_proj", "all-linear"))
    targets = lora.engine_targets
    command = sglang_command(
        SGLangServerArgs(model_path="/m", enable_lora=True, max_lora_rank=16, lora_target_modules=targets)
    )
    assert_known_flags(command)
    assert command[command.index("--enable-lora") : command.index("--log-level")] == lora.flags
    assert lora.flags[-2:] == ["q_proj", "all"]
    with pytest.raises(ValueError, match=r"takes none of \['w1'\]"):
        SGLangServerArgs(model_path="/m", enable_lora=True, max_lora_rank=8, lora_target_modules=["w1"])


@pytest.mark.parametrize(
    ("key", "flag"),
    [
        ("tp_size", "--tp-size"),
        ("--tp-size", "--tp-size"),
        ("tp", "--tp-size"),  # argparse would expand the prefix
        ("dp", "--dp-size"),
        ("model", "--model-path"),  # an alias
        ("tensor-parallel-size", "--tp-size"),
        ("nccl_init_addr", "--dist-init-addr"),
        ("mem-fraction-static", "--mem-fraction-static"),
        ("enable_memory_saver", "--enable-memory-saver"),
    ],
)
def test_extra_key_duplicating_a_field_is_rejected(key: str, flag: str) -> None:
    with pytest.raises(ValueError, match=f"extra key '{key}'.*would set {flag}"):
        SGLangServerArgs(model_path="/m", extra={key: 2})


def test_invalid_server_args() -> None:
    with pytest.raises(ValueError, match="dist_init_addr"):
        SGLangServerArgs(model_path="/m", tp_size=16, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        SGLangServerArgs(model_path="/m", nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="tp_size"):
        SGLangServerArgs(model_path="/m", tp_size=0)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerArgs(model_path="/m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="empty list"):
        sglang_command(SGLangServerArgs(model_path="/m", extra={"custom_weight_loader": []}))


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ((8, 8, 2, 1, 1), (4, 2, 1, 4)),
        ((2, 8, 2, 1, 1), (1, 2, 1, 4)),
        ((3, 8, 3, 1, 1), (1, 3, 1, 2)),  # one replica need not tile the node
        ((16, 8, 16, 1, 1), (1, 16, 2, 1)),
        ((32, 8, 8, 1, 2), (2, 16, 2, 1)),
        ((16, 8, 2, 2, 1), (4, 4, 1, 2)),
        ((24, 8, 4, 1, 1), (6, 4, 1, 2)),
    ],
)
def test_replica_layout(sizes: tuple[int, int, int, int, int], expected: tuple[int, int, int, int]) -> None:
    layout = replica_layout(*sizes)
    num_replicas, per_replica, nodes, per_node = expected
    assert layout == ReplicaLayout(
        num_replicas=num_replicas,
        devices_per_replica=per_replica,
        nodes_per_replica=nodes,
        devices_per_node=sizes[1],
        tp=sizes[2],
        dp=sizes[3],
        pp=sizes[4],
    )
    assert layout.replicas_per_node == per_node


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((6, 8, 4, 1, 1), r"6 rollout devices do not split into replicas of tp×dp×pp = 4×1×1 = 4; use a multiple of 4"),
        ((24, 8, 12, 1, 1), r"spans nodes of 8 devices without using whole nodes; make tp×dp×pp a multiple of 8"),
        ((24, 8, 3, 1, 1), r"do not tile a node of 8 devices .* make tp×dp×pp divide 8"),
        ((8, 8, 0, 1, 1), r"tp must be >= 1"),
        ((8, 0, 1, 1, 1), r"devices_per_node must be >= 1"),
    ],
)
def test_replica_layout_errors(sizes: tuple[int, int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replica_layout(*sizes)


def test_replica_node_args_errors() -> None:
    layout = replica_layout(16, 8, tp=16)
    base = SGLangServerArgs(model_path="/m", tp_size=16)
    with pytest.raises(ValueError, match="spans 2 node"):
        replica_node_args(base, layout, 0, ["10.0.0.1"], 1, 2)
    with pytest.raises(ValueError, match="replica_index 1 is outside"):
        replica_node_args(base, layout, 1, ["a", "b"], 1, 2)
    with pytest.raises(ValueError, match="differ from the layout"):
        replica_node_args(SGLangServerArgs(model_path="/m", tp_size=8), layout, 0, ["a", "b"], 1, 2)
