"""Weight sync: how the actor's weights reach the rollout replicas after each update."""

import os
from dataclasses import dataclass

from megarl.config.rollout import RolloutConfig

TRANSPORTS = ("auto", "tensor", "broadcast")
BACKENDS = ("auto", "gloo", "nccl")
TENSOR_FORMATS = ("flattened_bucket", "named_tensors")


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    transport: str = "auto"
    """tensor (handles to shared memory / CUDA IPC; colocated) | broadcast (gloo/NCCL group; separate
    pools) | auto (tensor when trainer.placement=colocated, else broadcast)."""
    bucket_bytes: int = 512 * 2**20
    """Most bytes gathered and sent at once; a sender holds at most two buckets + its largest tensor."""
    delta: bool = False
    """Send only tensors whose content changed since the last sync (a hash per tensor)."""
    tensor_format: str = "flattened_bucket"
    """How the tensor transport hands a bucket over (SGLang's update_weights_from_tensor load_format):
    flattened_bucket (one handle per bucket + offsets) | named_tensors (load_format=null, one handle
    per tensor)."""
    backend: str = "auto"
    """Broadcast backend: nccl on GPUs, gloo on CPU (auto)."""
    timeout_s: float = 600.0
    """Limit for each engine call, group join, broadcast and hand-over; the error names the bucket."""


def chosen_transport(cfg: SyncConfig, placement: str) -> str:
    """`tensor` or `broadcast`: the configured transport, with auto resolved from the placement."""
    if cfg.transport != "auto":
        return cfg.transport
    return "tensor" if placement == "colocated" else "broadcast"


def chosen_backend(cfg: SyncConfig, device: str) -> str:
    """`gloo` or `nccl`: the configured broadcast backend, with auto resolved from the device."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device == "cuda" else "gloo"


def trainer_env(cfg: SyncConfig, placement: str, device: str) -> dict[str, str]:
    """Environment variables of the trainer's workers. With an NCCL broadcast group they join the engines' NCCL
    setting: SGLang 0.5.23 sets `NCCL_CUMEM_ENABLE=0` in its server unless the variable is set
    (`entrypoints/engine.py:_set_envs_and_config`), and ranks of one communicator must agree. A value set for the
    driver is passed on as it is."""
    if chosen_transport(cfg, placement) != "broadcast" or chosen_backend(cfg, device) != "nccl":
        return {}
    return {"NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0")}


def delivery(cfg: SyncConfig, placement: str, device: str, nnodes: int, num_devices: int) -> str:
    """How the actor's weights reach the engines under this layout, in a sentence (megarl-plan, the run log)."""
    if chosen_transport(cfg, placement) == "broadcast":
        return f"broadcast: each owner rank broadcasts its buckets to every engine rank ({chosen_backend(cfg, device)})"
    if device == "cuda" and num_devices > 1:
        return (
            "tensor: each engine rank maps a copy on its own GPU (CUDA IPC by GPU UUID); an owner copies each bucket "
            "to the trainer rank on every other engine GPU first (sync.relay)"
        )
    if nnodes > 1:
        return (
            "tensor: each engine maps shared memory on its own node; an owner copies each bucket to one trainer "
            "rank on every other node first (sync.relay)"
        )
    return "tensor: every engine maps the owners' buckets directly"


def problems(cfg: SyncConfig, placement: str, device: str, rollout: RolloutConfig) -> list[str]:
    """What `validate()` reports about `sync.*` besides unknown names."""
    out = []
    if cfg.bucket_bytes < 2**20:
        out.append(f"sync.bucket_bytes={cfg.bucket_bytes} must be >= 1 MiB (1048576); 512 MiB suits GPUs")
    if cfg.timeout_s <= 0:
        out.append(f"sync.timeout_s={cfg.timeout_s} must be > 0 seconds")
    if cfg.backend == "nccl" and device == "cpu":
        out.append("sync.backend=nccl needs GPUs but trainer.device=cpu; use sync.backend=gloo or auto")
    broadcast = chosen_transport(cfg, placement) == "broadcast"
    if broadcast and rollout.pipeline_parallel_size > 1:
        out.append(
            "sync.transport=broadcast reaches engine ranks by TP rank only; set rollout.pipeline_parallel_size=1 "
            "or use more replicas"
        )
    if broadcast and placement == "colocated" and chosen_backend(cfg, device) == "nccl":
        out.append(
            "sync.transport=broadcast with trainer.placement=colocated puts a trainer rank and an engine rank of "
            "one NCCL group on the same GPU, which NCCL refuses; use sync.transport=tensor (or auto) when "
            "colocated, or trainer.placement=separate"
        )
    if rollout.engine == "sglang" and rollout.data_parallel_size > 1:
        out.append(
            f"rollout.data_parallel_size={rollout.data_parallel_size}: SGLang 0.5.23 takes weight updates only "
            "with --dp-size 1 (managers/tokenizer_control_mixin.py asserts it for update_weights_from_tensor, "
            "init_weights_update_group and update_weights_from_distributed) and refuses dp > 1 across nodes; "
            "set rollout.data_parallel_size=1 and get data parallelism from more replicas"
        )
    return out
