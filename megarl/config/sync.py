"""Weight sync: how the actor's weights reach the rollout replicas after each update."""

from dataclasses import dataclass

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
