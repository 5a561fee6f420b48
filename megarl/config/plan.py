"""Hardware facts `megarl-plan` checks a layout against; training itself does not read them."""

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    device_memory_gb: float = 80.0
    """Memory of one device in GB (10^9 bytes): 80 for H100/A100-80G, 141 for H200."""
    reserved_gb: float = 4.0
    """Per-device memory nobody can use: CUDA context, NCCL buffers, allocator fragmentation."""
    intra_node_gbps: float = 300.0
    """Achieved device-to-device bandwidth inside a node, GB/s (NVLink all-gather / IPC copies)."""
    inter_node_gbps: float = 40.0
    """Achieved bandwidth between nodes per device, GB/s (400 Gb/s InfiniBand ≈ 40 GB/s in practice)."""
    train_tflops: float = 400.0
    """Achieved training throughput per device, TFLOP/s (H100 bf16: ~40 % of its 989 peak)."""
    hbm_gbps: float = 2500.0
    """Achieved device-memory bandwidth per device, GB/s, what bounds decoding (H100 SXM: 3350 peak)."""
