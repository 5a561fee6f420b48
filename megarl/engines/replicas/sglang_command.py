"""SGLang server command lines, and how rollout devices split into replicas across nodes.

Pinned to sglang==0.5.23 (the `gpu` extra). A flag is `--` + a `ServerArgs` field name with dashes
(fields in `srt/server_args.py::ServerArgs`, flags derived in `srt/arg_groups/arg_utils.py` from the
field groups in `srt/arg_groups/fields/`); booleans are store_true. Nothing here imports sglang.

Usage, one TP16 replica over two 8-GPU nodes::

    layout = replica_layout(num_devices=16, devices_per_node=8, tp=16)
    base = SGLangServerArgs(model_path="/ckpt/hf", tp_size=16, load_format="dummy", enable_memory_saver=True)
    per_node = replica_node_args(base, layout, 0, ["10.0.0.1", "10.0.0.2"], port=30000, dist_port=20000)
    commands = [sglang_command(args) for args in per_node]
    health_url(per_node[0], "10.0.0.1")  # 'http://10.0.0.1:30000/health_generate'

Only node 0 of a replica serves the API; nodes >= 1 run a stub whose /health* always answers 200,
so their readiness is judged by their process being alive.
"""

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

LOOPBACK = "127.0.0.1"
"""SGLang's default --host: reachable from the same node only."""
ALL_INTERFACES = "0.0.0.0"
SGLANG_LORA_TARGETS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj"),
    *("wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"),
    *("embed_tokens", "lm_head", "qkvr", "wo_ud", "all"),
)
"""What `--lora-target-modules` takes: srt/utils/common.py::SUPPORTED_LORA_TARGET_MODULES and LORA_TARGET_ALL_MODULES
(the choices of srt/arg_groups/fields/lora.py::Lora.lora_target_modules)."""
HEALTH_PATH = "/health_generate"
"""200 once the weights and KV cache are loaded and the warmup generation passed (HS::health_generate).
`/model_info` answers 200 before the warmup, so it is no readiness signal."""


@dataclass(kw_only=True, slots=True)
class SGLangServerArgs:
    """Arguments of `python -m sglang.launch_server`; defaults are SGLang's, None = left to SGLang."""

    model_path: str
    """HF checkpoint directory (with load_format=dummy: only its config and tokenizer are read)."""
    host: str = LOOPBACK
    """Interface the HTTP API binds."""
    port: int = 30000
    """HTTP API port."""
    tp_size: int = 1
    """Tensor-parallel size: devices per model copy (across all nodes of the replica)."""
    dp_size: int = 1
    """Data-parallel copies inside one server."""
    pp_size: int = 1
    """Pipeline-parallel stages."""
    ep_size: int = 1
    """Expert-parallel size for MoE layers."""
    nnodes: int = 1
    """Nodes this server spans."""
    node_rank: int = 0
    """This node's rank among `nnodes`; rank 0 serves the API."""
    dist_init_addr: str | None = None
    """host:port of node 0 where the server's ranks rendezvous (torch.distributed); needed when nnodes > 1."""
    nccl_port: int | None = None
    """Port of a one-node server's own rendezvous; None = SGLang picks a free one at start-up, which
    replicas starting side by side on one node can race for (server_args.py::PortArgs.init_new)."""
    mem_fraction_static: float | None = None
    """Device memory share for weights + KV cache; None = SGLang picks."""
    enable_memory_saver: bool = False
    """Let /release_memory_occupation really free weights, KV cache and CUDA graphs (colocated training)."""
    enable_weights_cpu_backup: bool = False
    """Keep a CPU copy of the weights so a release/resume restores their values."""
    load_format: str = "auto"
    """auto (read the checkpoint) | dummy (random weights; colocated start where weights come from sync) | ..."""
    disable_cuda_graph: bool = False
    """Run decode eagerly (deprecated in SGLang but still applied)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels: outputs independent of batch composition (ExecDeterministic, fields/exec_.py)."""
    attention_backend: str | None = None
    """e.g. fa3, flashinfer, triton; None = SGLang picks for the device."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (the checkpoint's) | bfloat16 | float16 | float32."""
    context_length: int | None = None
    """Longest prompt + response in tokens; None = the model config's."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own modeling code."""
    skip_tokenizer_init: bool = False
    """Token ids in and out only: /generate then returns no `text` and rejects string stops."""
    is_embedding: bool = False
    """Serve the model as an embedding or classification model: `/classify` and `/encode` answer, `/generate` does
    not (ServerArgs.is_embedding, srt/arg_groups/fields/model.py; a `*ForSequenceClassification` checkpoint is one
    already, configs/model_config.py::is_generation_model)."""
    api_key: str | None = None
    """Bearer key of /generate and the reads (and of the control endpoints without `admin_api_key`); see
    `megarl.engines.client.auth`."""
    admin_api_key: str | None = None
    """Bearer key of the control endpoints (weights, memory, pause, abort, flush); the only one they take when set."""
    log_level: str = "info"
    """SGLang's logging level."""
    base_gpu_id: int = 0
    """First device index (among those the server sees) this server uses."""
    max_running_requests: int | None = None
    """Cap on concurrently decoded requests; None = SGLang picks from the KV cache size."""
    enable_return_routed_experts: bool = False
    """Capture each MoE layer's top-k experts per token, returned to /generate calls with return_routed_experts."""
    enable_lora: bool = False
    """Serve LoRA adapters loaded at run time (/load_lora_adapter_from_tensors), named per request by lora_path."""
    max_lora_rank: int | None = None
    """The highest adapter rank the LoRA memory pool takes (with enable_lora)."""
    lora_target_modules: list[str] | None = None
    """The projections adapters may target (`SGLANG_LORA_TARGETS`; `all` = any), with enable_lora."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other ServerArgs field: `foo_bar: v` → `--foo-bar v`; True → bare flag; False/None → omitted;
    a list → its values after one flag; a dict → JSON text."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SGLangServerArgs.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"SGLangServerArgs.node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(
                f"SGLangServerArgs.dist_init_addr (node 0's host:port) is required for nnodes={self.nnodes}"
            )
        if unknown := sorted(set(self.lora_target_modules or ()) - set(SGLANG_LORA_TARGETS)):
            raise ValueError(
                f"SGLangServerArgs.lora_target_modules: SGLang 0.5.23 takes none of {unknown}; "
                f"use names of {SGLANG_LORA_TARGETS}"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"SGLangServerArgs.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for key in self.extra:
            clash = _typed_field_set_by(key)
            if clash is not None:
                raise ValueError(
                    f"SGLangServerArgs.extra key {key!r} ({_flag_name(key)}) would set {_flag_name(clash)}: "
                    f"set SGLangServerArgs.{clash} instead"
                )


# The typed fields in command-line order. Each is the ServerArgs field of the same name (`srt/server_args.py`,
# declared in its group under `srt/arg_groups/fields/`); `--<name-with-dashes>` per `srt/arg_groups/arg_utils.py`.
_TYPED_FLAGS = (
    # model
    "model_path",  # ServerArgs.model_path, required
    "dtype",  # ServerArgs.dtype
    "load_format",  # ServerArgs.load_format
    "context_length",  # ServerArgs.context_length
    "trust_remote_code",  # ServerArgs.trust_remote_code, store_true
    "skip_tokenizer_init",  # ServerArgs.skip_tokenizer_init, store_true
    "is_embedding",  # ServerArgs.is_embedding, store_true (fields/model.py)
    # network and auth
    "host",  # ServerArgs.host
    "port",  # ServerArgs.port
    "api_key",  # ServerArgs.api_key
    "admin_api_key",  # ServerArgs.admin_api_key
    # parallelism: the full names; `--tp`/`--dp` only work as argparse prefixes and `--pp` is ambiguous
    "tp_size",  # ServerArgs.tp_size
    "dp_size",  # ServerArgs.dp_size
    "pp_size",  # ServerArgs.pp_size
    "ep_size",  # ServerArgs.ep_size
    # multi-node
    "nnodes",  # ServerArgs.nnodes
    "node_rank",  # ServerArgs.node_rank
    "dist_init_addr",  # ServerArgs.dist_init_addr, host:port
    "nccl_port",  # ServerArgs.nccl_port
    # memory
    "mem_fraction_static",  # ServerArgs.mem_fraction_static
    "enable_memory_saver",  # ServerArgs.enable_memory_saver, store_true
    "enable_weights_cpu_backup",  # ServerArgs.enable_weights_cpu_backup, store_true
    # kernels and devices
    "attention_backend",  # ServerArgs.attention_backend
    "disable_cuda_graph",  # ServerArgs.disable_cuda_graph, store_true (deprecated, still applied: add_cli_args)
    "enable_deterministic_inference",  # ServerArgs.enable_deterministic_inference, store_true (fields/exec_.py)
    "base_gpu_id",  # ServerArgs.base_gpu_id
    "max_running_requests",  # ServerArgs.max_running_requests
    # outputs
    "enable_return_routed_experts",  # ServerArgs.enable_return_routed_experts, store_true (fields/exec_.py)
    # LoRA (fields/lora.py)
    "enable_lora",  # ServerArgs.enable_lora
    "max_lora_rank",  # ServerArgs.max_lora_rank
    "lora_target_modules",  # ServerArgs.lora_target_modules, nargs="*"
    # logging
    "log_level",  # ServerArgs.log_level
)


# Other spellings SGLang's parser accepts for typed fields (`Arg(aliases=...)` in `srt/arg_groups/fields/`, read
# upstream). Refusing one is safe even in a version without it: there it would be an unknown flag.
_ALIASES = {
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
    "data_parallel_size": "dp_size",
    "pipeline_parallel_size": "pp_size",
    "expert_parallel_size": "ep_size",
    "ep": "ep_size",
    "nccl_init_addr": "dist_init_addr",
}


def _typed_field_set_by(key: str) -> str | None:
    """The typed field an extra key would set: its own name, an alias, or a prefix argparse expands to it."""
    name = key.lstrip("-").replace("-", "_")
    if name in _ALIASES:
        return _ALIASES[name]
    return next((typed for typed in _TYPED_FLAGS if typed.startswith(name)), None)


def _flag_name(key: str) -> str:
    """`foo_bar`, `foo-bar` or `--foo-bar` → `--foo-bar`."""
    return "--" + key.lstrip("-").replace("_", "-")


def _flag(key: str, value: Any) -> list[str]:
    flag = _flag_name(key)
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError(f"SGLangServerArgs.extra[{key!r}] is an empty list; drop the key instead")
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def sglang_command(args: SGLangServerArgs, python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server` with every set argument spelled out (None and False are left out)."""
    command = [python, "-m", "sglang.launch_server"]
    for name in _TYPED_FLAGS:
        command += _flag(name, getattr(args, name))
    for key, value in args.extra.items():
        command += _flag(key, value)
    return command


def server_url(args: SGLangServerArgs, node_address: str) -> str:
    """Base URL of the API of a server started with `args` on the node at `node_address`."""
    host = node_address if args.host in (ALL_INTERFACES, "::") else args.host
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def health_url(args: SGLangServerArgs, node_address: str) -> str:
    """The readiness URL of node 0 of a replica."""
    return server_url(args, node_address) + HEALTH_PATH


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """How rollout devices split into SGLang replicas (one server each) and replicas into nodes.

    Replicas are numbered node-major: replica i uses devices [i·d, (i+1)·d) of the rollout devices,
    d = devices_per_replica, counting node by node.
    """

    num_replicas: int
    devices_per_replica: int
    """tp × dp × pp."""
    nodes_per_replica: int
    devices_per_node: int
    tp: int
    dp: int
    pp: int

    @property
    def replicas_per_node(self) -> int:
        """Replicas sharing one node (1 for replicas that span nodes)."""
        return max(1, self.devices_per_node // self.devices_per_replica)


def replica_layout(num_devices: int, devices_per_node: int, tp: int, dp: int = 1, pp: int = 1) -> ReplicaLayout:
    """Split `num_devices` rollout devices into replicas of tp × dp × pp devices.

    A replica either fits inside one node, with replicas tiling each node, or spans whole nodes.
    """
    sizes = {"num_devices": num_devices, "devices_per_node": devices_per_node, "tp": tp, "dp": dp, "pp": pp}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"replica_layout: {name} must be >= 1, got {value}")
    per_replica = tp * dp * pp
    if num_devices % per_replica:
        raise ValueError(
            f"{num_devices} rollout devices do not split into replicas of tp×dp×pp = {tp}×{dp}×{pp} = {per_replica}; "
            f"use a multiple of {per_replica} devices or sizes whose product divides {num_devices}"
        )
    if per_replica > devices_per_node and per_replica % devices_per_node:
        raise ValueError(
            f"a replica of tp×dp×pp = {per_replica} devices spans nodes of {devices_per_node} devices "
            f"without using whole nodes; make tp×dp×pp a multiple of {devices_per_node}"
        )
    if per_replica < devices_per_node < num_devices and devices_per_node % per_replica:
        raise ValueError(
            f"replicas of tp×dp×pp = {per_replica} devices do not tile a node of {devices_per_node} devices "
            f"(one would straddle two nodes); make tp×dp×pp divide {devices_per_node}"
        )
    return ReplicaLayout(
        num_replicas=num_devices // per_replica,
        devices_per_replica=per_replica,
        nodes_per_replica=math.ceil(per_replica / devices_per_node),
        devices_per_node=devices_per_node,
        tp=tp,
        dp=dp,
        pp=pp,
    )


def replica_node_args(
    base: SGLangServerArgs,
    layout: ReplicaLayout,
    replica_index: int,
    node_addresses: list[str],
    port: int,
    dist_port: int,
    own_devices_only: bool = False,
) -> list[SGLangServerArgs]:
    """The server arguments of each node of replica `replica_index`, in node-rank order.

    `node_addresses` are this replica's nodes, node 0 first; every node gets nnodes, its node_rank
    and dist_init_addr = node 0's address:`dist_port` (a fixed rendezvous port keeps replicas that
    share a node from racing for the same random one).

    Host: a replica inside one node binds `base.host` (SGLang's 127.0.0.1 unless configured, e.g.
    0.0.0.0 when clients on other nodes must reach it). A replica spanning nodes fills them, so its
    clients run elsewhere: when `base.host` is the loopback default, node 0 binds all interfaces,
    which makes the API reachable at node 0's routable address.

    Devices: a replica inside one node uses devices base_gpu_id + k·devices_per_replica onwards,
    k = its slot on the node, assuming the server sees all devices of its node in order; with
    `own_devices_only` (CUDA_VISIBLE_DEVICES lists just the replica's devices, from Ray) it starts at
    base_gpu_id.
    """
    sizes = (base.tp_size, base.dp_size, base.pp_size)
    if sizes != (layout.tp, layout.dp, layout.pp):
        raise ValueError(
            f"SGLangServerArgs tp/dp/pp sizes {sizes} differ from the layout's {(layout.tp, layout.dp, layout.pp)}; "
            "build both from the same sizes"
        )
    if not 0 <= replica_index < layout.num_replicas:
        raise ValueError(f"replica_index {replica_index} is outside [0, {layout.num_replicas})")
    if len(node_addresses) != layout.nodes_per_replica:
        raise ValueError(
            f"replica {replica_index} spans {layout.nodes_per_replica} node(s) but got {len(node_addresses)} "
            f"node addresses: {node_addresses}"
        )
    if layout.nodes_per_replica == 1:
        host = base.host
        slot = 0 if own_devices_only else replica_index % layout.replicas_per_node
        base_gpu_id = base.base_gpu_id + slot * layout.devices_per_replica
    else:
        host = ALL_INTERFACES if base.host == LOOPBACK else base.host
        base_gpu_id = base.base_gpu_id
    return [
        dataclasses.replace(
            base,
            host=host,
            port=port,
            nnodes=layout.nodes_per_replica,
            node_rank=rank,
            dist_init_addr=f"{node_addresses[0]}:{dist_port}",
            base_gpu_id=base_gpu_id,
            extra=dict(base.extra),
        )
        for rank in range(layout.nodes_per_replica)
    ]
