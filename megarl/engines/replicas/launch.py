"""Start the rollout replicas that `rollout.*` describes, on Ray, and hand back their URLs.

`rollout.engine=sglang`: replicas of tp×dp×pp devices (one SGLang server each, spanning nodes when
larger than a node). `rollout.engine=embedded`: one embedded engine per device (a CPU slot or a
GPU). Either way the result is a list of HTTP endpoints speaking the same protocol, for the router.
With a `LoraServing` both kinds start with `--enable-lora --max-lora-rank R --lora-target-modules ...`; with
`classify` both start with `--is-embedding` and serve `/classify` (a reward model's pool: `reward_engines.py`).
"""

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ray.util.placement_group import PlacementGroup

from megarl.config.lora import ALL_LINEAR, LoraConfig
from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.sglang_api import HEALTH_PATH
from megarl.engines.replicas.placement import BundleSite, memory_site, node_groups
from megarl.engines.replicas.replica import PortLedger, ReplicaHandle
from megarl.engines.replicas.sglang_command import (
    ALL_INTERFACES,
    LOOPBACK,
    ReplicaLayout,
    SGLangServerArgs,
    replica_layout,
    replica_node_args,
    server_url,
    sglang_command,
)


@dataclass(frozen=True, slots=True)
class LoraServing:
    """The engines serve LoRA adapters loaded at run time (SGLang's --enable-lora), at most this rank, on these
    projections."""

    max_rank: int
    target_modules: tuple[str, ...]
    """HF projection names (`megarl.config.lora.LORA_TARGETS`), or PEFT's `all-linear`."""

    @property
    def engine_targets(self) -> list[str]:
        """`--lora-target-modules`' values: these names, PEFT's `all-linear` as the engines' `all`."""
        return ["all" if name == ALL_LINEAR else name for name in self.target_modules]

    @property
    def flags(self) -> list[str]:
        """The command-line flags, the same for SGLang and the embedded engine."""
        return ["--enable-lora", "--max-lora-rank", str(self.max_rank), "--lora-target-modules", *self.engine_targets]


def lora_serving(lora: LoraConfig) -> LoraServing | None:
    """What `actor.lora` asks of the engines: adapters each step when it trains LoRA with sync=adapter, else none."""
    if not lora.enabled or lora.sync != "adapter":
        return None
    return LoraServing(max_rank=lora.rank, target_modules=tuple(lora.target_modules))


def engine_layout(cfg: RolloutConfig, num_devices: int, devices_per_node: int) -> ReplicaLayout:
    """How `num_devices` rollout devices split into replicas (ValueError naming the sizes if they cannot)."""
    if cfg.engine == "embedded":
        return replica_layout(num_devices, devices_per_node, tp=1)
    return replica_layout(
        num_devices, devices_per_node, cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.pipeline_parallel_size
    )


def engine_dtype(cfg: RolloutConfig, model: ModelConfig) -> str:
    """`rollout.dtype`, where auto means the trained model's `model.dtype`."""
    return model.dtype if cfg.dtype == "auto" else cfg.dtype


def engine_load_format(cfg: RolloutConfig, model: ModelConfig) -> str:
    """`rollout.load_format`, except dummy when the model has no weights on disk (`model.random_init`)."""
    return "dummy" if model.random_init else cfg.load_format


def sglang_base_args(
    cfg: RolloutConfig,
    model: ModelConfig,
    host: str,
    keys: EngineKeys,
    lora: LoraServing | None = None,
    classify: bool = False,
) -> SGLangServerArgs:
    """The SGLang server arguments every replica shares (ports, ranks and addresses come per node); `classify`
    serves the model through `/classify` (`--is-embedding`)."""
    extra = dict(cfg.engine_kwargs)
    if model.tokenizer_path is not None:
        extra.setdefault("tokenizer_path", model.tokenizer_path)
    return SGLangServerArgs(
        model_path=model.path,
        host=host,
        tp_size=cfg.tensor_parallel_size,
        dp_size=cfg.data_parallel_size,
        pp_size=cfg.pipeline_parallel_size,
        ep_size=cfg.expert_parallel_size,
        dtype=engine_dtype(cfg, model),
        load_format=engine_load_format(cfg, model),
        context_length=model.max_model_len,
        trust_remote_code=model.trust_remote_code,
        is_embedding=classify,
        mem_fraction_static=cfg.mem_fraction_static,
        enable_memory_saver=cfg.enable_memory_saver,
        enable_weights_cpu_backup=cfg.enable_weights_cpu_backup,
        disable_cuda_graph=not cfg.enable_cuda_graph,
        enable_deterministic_inference=cfg.deterministic_inference,
        attention_backend=cfg.attention_backend,
        max_running_requests=cfg.max_running_requests,
        enable_return_routed_experts=cfg.return_routed_experts,
        enable_lora=lora is not None,
        max_lora_rank=None if lora is None else lora.max_rank,
        lora_target_modules=None if lora is None else lora.engine_targets,
        api_key=keys.api,
        admin_api_key=keys.admin,
        extra=extra,
    )


def embedded_command(
    cfg: RolloutConfig,
    model: ModelConfig,
    host: str,
    port: int,
    device: str,
    keys: EngineKeys,
    lora: LoraServing | None = None,
    classify: bool = False,
) -> list[str]:
    """`python -m megarl.engines.embedded ...` for one device (`cpu` or `cuda:N`); `classify` serves a
    `*ForSequenceClassification` checkpoint through `/classify` (`--is-embedding`: engines/embedded/classify.py)."""
    command = [sys.executable, "-m", "megarl.engines.embedded", "--model-path", model.path]
    command += ["--host", host, "--port", str(port), "--device", device, "--dtype", engine_dtype(cfg, model)]
    command += ["--load-format", engine_load_format(cfg, model)]
    if model.max_model_len is not None:
        command += ["--context-length", str(model.max_model_len)]
    if cfg.max_running_requests is not None:
        command += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.enable_weights_cpu_backup:
        command.append("--enable-weights-cpu-backup")
    if cfg.return_routed_experts:
        command.append("--enable-return-routed-experts")
    if cfg.deterministic_inference:
        command.append("--enable-deterministic-inference")
    command += [] if lora is None else lora.flags
    if classify:
        command.append("--is-embedding")
    # a classifier's text inputs and a vision-language model's image processor are read from the tokenizer directory
    command += ["--tokenizer-path", model.tokenizer_path] if model.tokenizer_path else []
    for flag, key in (("--api-key", keys.api), ("--admin-api-key", keys.admin)):
        command += [flag, key] if key else []
    for key, value in cfg.engine_kwargs.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command


@dataclass(kw_only=True, slots=True)
class LaunchedReplicas:
    """The replicas `launch_engines` started, to stop them; `urls[i]` is replica i's API. Calls to every replica
    at once go through a `Fleet` of clients connected to `urls`."""

    replicas: list[ReplicaHandle]
    urls: list[str]
    sites: list[tuple[str, ...]]
    """Replica i's `memory_site` per engine rank, in TP rank order; () where placement was not read."""
    keys: EngineKeys
    """What every client of these replicas authenticates with."""

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """Where one replica runs: a bundle per node (None = wherever Ray likes) and each node's environment."""

    bundles: list[int] | None
    node_envs: list[dict[str, str]]
    own_devices_only: bool
    """Each server sees only its own devices (CUDA_VISIBLE_DEVICES from Ray), so it indexes them from 0."""


def replica_placement(
    layout: ReplicaLayout, replica: int, sites: Sequence[BundleSite] | None, device: str
) -> ReplicaPlacement:
    """Replica `replica`'s share of `sites` (sorted by node and GPU id), or the node's devices by index."""
    if sites is None:
        # No placement read from Ray: servers see every device of their node and pick theirs by index.
        visible = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(layout.devices_per_node)))}
        return ReplicaPlacement(None, [visible if device == "cuda" else {}] * layout.nodes_per_replica, False)
    first = replica * layout.devices_per_replica
    nodes = node_groups(sites[first : first + layout.devices_per_replica])
    if len(nodes) != layout.nodes_per_replica:
        raise RuntimeError(
            f"replica {replica}'s {layout.devices_per_replica} devices landed on {len(nodes)} node(s) "
            f"{[n[0].node_ip for n in nodes]}, not {layout.nodes_per_replica}: Ray placed the bundles unevenly; "
            "make trainer.devices_per_node match the devices each node offers"
        )
    envs = [
        {"CUDA_VISIBLE_DEVICES": ",".join(g for site in node for g in site.gpu_ids)} if device == "cuda" else {}
        for node in nodes
    ]
    return ReplicaPlacement([node[0].index for node in nodes], envs, device == "cuda")


def replica_sites(
    layout: ReplicaLayout, replica: int, sites: Sequence[BundleSite] | None, device: str
) -> tuple[str, ...]:
    """Each engine rank's memory site: rank i of replica r runs on site r·d + i (d devices a replica)."""
    if sites is None:
        return ()
    first = replica * layout.devices_per_replica
    return tuple(memory_site(site, device) for site in sites[first : first + layout.devices_per_replica])


def launch_engines(
    cfg: RolloutConfig,
    model: ModelConfig,
    *,
    num_devices: int,
    devices_per_node: int,
    device: str,
    log_dir: Path,
    keys: EngineKeys,
    placement_group: PlacementGroup | None = None,
    sites: Sequence[BundleSite] | None = None,
    multi_node: bool = False,
    num_cpus: float = 1.0,
    lora: LoraServing | None = None,
    classify: bool = False,
) -> LaunchedReplicas:
    """Start every replica, then wait until all answer /health_generate.

    `device` is cuda or cpu. With a placement group of one bundle per device, `sites` (its bundles as
    `locate_bundles` found them) assigns devices: replica r takes sites [r·d, (r+1)·d), its node k
    runs on the bundle of its first device there and sees exactly its GPUs. `multi_node` binds
    servers to all interfaces so clients on other nodes reach them. `num_cpus` is what each replica's
    node actor reserves (a share of the bundle when the engines are colocated with trainer roles). On
    any failure the replicas started so far are stopped. Every server takes `keys` (`megarl.engines.client.auth`; the
    caller makes one `EngineKeys.generate()` per run, tests may pass `EngineKeys()` for none). With `lora`
    (`lora_serving(cfg.actor.lora)`) every server serves LoRA adapters; with `classify` every server serves the
    model through `/classify` (`--is-embedding`) instead of `/generate`.
    """
    if (placement_group is None) != (sites is None):
        raise ValueError("give placement_group and its sites together (locate_bundles), or neither")
    layout = engine_layout(cfg, num_devices, devices_per_node)
    host = ALL_INTERFACES if multi_node else LOOPBACK
    launched = LaunchedReplicas(replicas=[], urls=[], sites=[], keys=keys)
    ledger = PortLedger()
    try:
        for r in range(layout.num_replicas):
            where = replica_placement(layout, r, sites, device)
            replica = ReplicaHandle.create(
                layout.nodes_per_replica,
                placement_group=placement_group,
                bundle_indices=where.bundles,
                num_cpus=num_cpus,
            )
            launched.replicas.append(replica)
            ips = replica.node_ips()
            if cfg.engine == "sglang":
                port, dist_port, nccl_port = replica.reserve_ports(3, ledger)
                base = sglang_base_args(cfg, model, host, keys, lora, classify)
                base = dataclasses.replace(base, nccl_port=nccl_port)
                per_node = replica_node_args(base, layout, r, ips, port, dist_port, where.own_devices_only)
                commands, url = [sglang_command(a) for a in per_node], server_url(per_node[0], ips[0])
            else:
                (port,) = replica.reserve_ports(1, ledger)
                slot = (
                    "cpu" if device == "cpu" else "cuda:0" if where.own_devices_only else f"cuda:{r % devices_per_node}"
                )
                commands = [embedded_command(cfg, model, host, port, slot, keys, lora, classify)]
                url = f"http://{ips[0] if multi_node else LOOPBACK}:{port}"
            replica.start(commands, url=url, log_dir=str(log_dir / f"replica{r}"), node_envs=where.node_envs)
            launched.urls.append(url)
            launched.sites.append(replica_sites(layout, r, sites, device))
        for replica in launched.replicas:
            replica.wait_healthy(HEALTH_PATH, cfg.server_start_timeout_s)
    except BaseException:
        launched.stop()
        raise
    return launched
