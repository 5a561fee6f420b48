"""Weight sync on GPUs: Megatron over NCCL into embedded engines by CUDA IPC (same device) and by a
broadcast group: NCCL with the engine on a second GPU, else gloo on the same GPU (NCCL refuses two
ranks of one group on one device, and `validate()` refuses that config). Skipped without a GPU (on CPU
under device_check.sh --dry)."""

from pathlib import Path

import torch
from cases.engine_cases import start_engine
from cases.megatron_cases import layout, save_asset_model
from cases.sync_cases import Replicas, rank_sync_twice
from gpu_cases import BACKEND, CUDA, needs_device, record

from megarl.megatron.launch import spawn

pytestmark = needs_device


def test_cuda_engines_match_the_trainer_after_each_of_two_syncs(tmp_path: Path) -> None:
    model_dir = save_asset_model("tiny_dense", tmp_path / "dense")
    two_gpus = torch.cuda.device_count() >= 2
    devices, broadcast_backend = (["cuda:0", "cuda:1"], "nccl") if two_gpus else (["cuda:0", "cuda:0"], "gloo")
    devices = devices if CUDA else ["cpu", "cpu"]
    servers = [start_engine(model_dir, tmp_path, "--load-format", "dummy", "--device", d) for d in devices]
    try:
        replicas = Replicas(tensor=[servers[0][1]], broadcast=[servers[1][1]])
        out = spawn(rank_sync_twice, 1, model_dir, layout(1), replicas, 2**20, broadcast_backend, backend=BACKEND)[0]
    finally:
        for server, _ in servers:
            server.stop()
    record("sync/gaps", **out["gaps"])
    for key, gap in out["gaps"].items():
        if not key.startswith("stale/"):
            assert gap <= 1e-4, (key, gap)
    for kind in ("tensor", "broadcast"):
        assert out["metrics"][f"1/{kind}"].bytes == out["metrics"][f"2/{kind}"].bytes > 0
