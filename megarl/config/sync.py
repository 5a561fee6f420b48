"""Weight sync: how the actor's weights reach the rollout replicas after each update."""

from dataclasses import dataclass

from megarl.config.rollout import RolloutConfig

TRANSPORTS = ("auto", "tensor", "broadcast")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    transport: str = "auto"
    """tensor (handles to shared memory / CUDA IPC; colocated) | broadcast (gloo/NCCL group; separate
    pools) | auto (tensor when trainer.placement=colocated, else broadcast)."""
    bucket_bytes: int = 512 * 2**20
    """Most bytes gathered and sent at once; a sender holds at most two buckets + its largest tensor."""
    delta: bool = False
    """Send only tensors whose content changed since the last sync (a hash per tensor)."""
    backend: str = "auto"
    """Broadcast backend: nccl on GPUs, gloo on CPU (auto)."""
    timeout_s: float = 600.0
    """Limit for each engine call, group join, broadcast and hand-over; the error names the bucket."""


def chosen_transport(cfg: SyncConfig, placement: str) -> str:
    """`tensor` or `broadcast`: the configured transport, with auto resolved from the placement."""
    if cfg.transport != "auto":
        return cfg.transport
    return "tensor" if placement == "colocated" else "broadcast"


def problems(cfg: SyncConfig, placement: str, device: str, rollout: RolloutConfig) -> list[str]:
    """What `validate()` reports about `sync.*` besides unknown names."""
    out = []
    if cfg.bucket_bytes < 2**20:
        out.append(f"sync.bucket_bytes={cfg.bucket_bytes} must be >= 1 MiB (1048576); 512 MiB suits GPUs")
    if cfg.timeout_s <= 0:
        out.append(f"sync.timeout_s={cfg.timeout_s} must be > 0 seconds")
    if cfg.backend == "nccl" and device == "cpu":
        out.append("sync.backend=nccl needs GPUs but trainer.device=cpu; use sync.backend=gloo or auto")
    if (
        chosen_transport(cfg, placement) == "broadcast"
        and rollout.pipeline_parallel_size * rollout.data_parallel_size > 1
    ):
        out.append(
            "sync.transport=broadcast reaches engine ranks by TP rank only; set rollout.pipeline_parallel_size=1 "
            "and rollout.data_parallel_size=1, or use more replicas"
        )
    return out
