"""Weight sync speed against its transport floor, for both transports (the tensor one in both of its
formats: one handle per bucket, one per tensor), and delta sync's bytes.

Megatron ranks (gloo on CPU, NCCL with --device cuda) hold a model of `--hidden`/`--layers`
(random weights); embedded engines started with dummy weights receive it. For each transport the
script alternates `--rounds` times: the transport floor (the same buckets pushed through the same
transport from one pre-filled buffer: no gather, no transform, no overlap) and a real sync. It
prints best-of-rounds seconds, GB/s and sync/floor throughput (goal ≥ 0.7), checks the engines'
log-probs against the trainer's after the last sync, then changes two tensors and reports what a
delta sync sends. Beside them, the copy floor: one plain copy of the same bytes between two buffers on the
trainer's device (on a GPU the HBM floor; `sync/HBM copy` is the fraction of it a sync reaches). On one GPU the
broadcast group runs over gloo (NCCL refuses two ranks of one group on one device); with two, the broadcast
engine sits on the second GPU and the group uses NCCL.

    .venv/bin/python bench/sync.py [--hidden 512 --layers 8] [--tp 1] [--bucket-mb 64] [--rounds 3]
    .venv/bin/python bench/sync.py --lora 16 [--tp 2]       # LoRA: adapter vs merged sync (bench/lora_sync.py)
    .venv/bin/python bench/sync.py --device cuda --config megarl/assets/models/qwen2_5_1_5b/config.json \
        --bucket-mb 512 --json sync.json
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lora_sync
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import start_engine, write_engine_config
from cases.megatron_cases import layout
from cases.sync_cases import log_prob_gap

from megarl.config.sync import SyncConfig
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.launch import spawn
from megarl.megatron.model import build_model
from megarl.megatron.parallel import ParallelLayout, build_role_groups
from megarl.models.spec import load_hf_config, model_spec
from megarl.sync.build import build_syncer
from megarl.sync.transport import EngineTarget


def copy_floor(num_bytes: int, device: torch.device, rounds: int) -> float:
    """Best-of-`rounds` seconds of one plain copy of `num_bytes` between two buffers on `device` (on a GPU, the
    HBM floor of moving the weights once: whatever a sync does, it moves at least these bytes)."""
    source = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(rounds + 1):  # the first copy warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def rank_bench(
    model_dir: Path,
    role_layout: ParallelLayout,
    urls: dict[str, str],
    bucket_bytes: int,
    rounds: int,
    cuda: bool,
    broadcast_backend: str,
) -> dict:
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(role_layout)
    model = build_model(spec, groups, params_dtype=dtype)
    out: dict = {}
    for kind, (url, cfg) in _variants(urls, bucket_bytes, broadcast_backend).items():
        syncer = build_syncer(model, groups, cfg, "colocated", [EngineTarget(url)], dtype)
        first = syncer.sync()  # opens the transport
        floors, syncs = [], []
        for _ in range(rounds):
            floors.append(syncer.transport_floor())
            syncs.append(syncer.sync())
        best = min(syncs, key=lambda m: m.seconds)
        gap = log_prob_gap(MegatronEngine(model, groups), url)[0]
        out[kind] = {"first": first, "best": best, "floor_s": min(floors), "gap": gap, "syncs": syncs}
        syncer.close()
    cfg = SyncConfig(transport="tensor", bucket_bytes=bucket_bytes, delta=True)
    syncer = build_syncer(model, groups, cfg, "colocated", [EngineTarget(urls["tensor"])], dtype)
    full = syncer.sync()
    with torch.no_grad():
        layer = model.chunks[0].decoder.layers[0]
        for param in (layer.input_layernorm.weight, layer.self_attention.linear_proj.weight):
            param.add_(0.01)
    delta = syncer.sync()
    gap = log_prob_gap(MegatronEngine(model, groups), urls["tensor"])[0]
    syncer.close()
    out["delta"] = {"full": full, "delta": delta, "gap": gap}
    out["copy_floor_s"] = copy_floor(full.bytes, next(model.chunks[0].parameters()).device, rounds)
    return out


def _variants(urls: dict[str, str], bucket_bytes: int, broadcast_backend: str) -> dict[str, tuple[str, SyncConfig]]:
    """Label → (engine URL, sync config) of each measured way to sync."""
    return {
        "tensor": (urls["tensor"], SyncConfig(transport="tensor", bucket_bytes=bucket_bytes)),
        "tensor/1h": (
            urls["tensor"],
            SyncConfig(transport="tensor", bucket_bytes=bucket_bytes, tensor_format="named_tensors"),
        ),
        "broadcast": (
            urls["broadcast"],
            SyncConfig(transport="broadcast", bucket_bytes=bucket_bytes, backend=broadcast_backend),
        ),
    }


def _broadcast_side(cuda: bool) -> tuple[str, str]:
    """(the broadcast engine's device, the group's backend): NCCL with the engine on a second GPU; on one GPU,
    gloo (NCCL refuses two ranks of one group on one device); gloo on CPU."""
    if cuda and torch.cuda.device_count() >= 2:
        return "cuda:1", "nccl"
    return ("cuda:0" if cuda else "cpu"), "gloo"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--config", type=Path, help="a HF config.json to use instead of the widened tiny model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--lora", type=int, metavar="RANK", help="LoRA: adapter vs merged sync")
    return parser.parse_args()


def _run(args: argparse.Namespace, work: Path, servers: list) -> tuple[dict, str]:
    cuda = args.device == "cuda"
    model_dir = work / "model"
    if args.config:
        model_dir.mkdir()
        config = json.loads(args.config.read_text())
        (model_dir / "config.json").write_text(json.dumps(config))
    else:
        write_engine_config(model_dir, args.hidden, args.layers)
    engine_args = ["--load-format", "dummy", "--dtype", "bfloat16" if cuda else "float32"]
    broadcast_device, broadcast_backend = _broadcast_side(cuda)
    devices = {"tensor": "cuda:0" if cuda else "cpu", "broadcast": broadcast_device}
    urls = {}
    for kind, device in devices.items():
        server, urls[kind] = start_engine(model_dir, work, *engine_args, "--device", device)
        servers.append(server)
    results = spawn(
        rank_bench,
        args.tp,
        model_dir,
        layout(args.tp, tp=args.tp),
        urls,
        args.bucket_mb * 2**20,
        args.rounds,
        cuda,
        broadcast_backend,
        backend="nccl" if cuda else "gloo",
    )[0]
    return results, broadcast_backend


def _report(args: argparse.Namespace, results: dict, broadcast_backend: str) -> dict:
    """Prints the figures; returns them as plain numbers."""
    total, copy_s = results["tensor"]["best"].bytes, results["copy_floor_s"]
    floor_name = "HBM copy" if args.device == "cuda" else "memory copy"
    print(
        f"model: {total / 1e6:.1f} MB in the engine's dtype, TP={args.tp}, bucket {args.bucket_mb} MiB, {args.device}"
        f" (tensor = flattened_bucket, one handle per bucket; tensor/1h = named_tensors, one per tensor; "
        f"broadcast over {broadcast_backend}) | {floor_name} of the same bytes {copy_s:.4f} s "
        f"({total / 1e9 / copy_s:.1f} GB/s)"
    )
    figures: dict = {
        "bytes": total,
        "device": args.device,
        "copy_floor_s": copy_s,
        "broadcast_backend": broadcast_backend,
    }
    for kind in ("tensor", "tensor/1h", "broadcast"):
        r = results[kind]
        best, floor_s = r["best"], r["floor_s"]
        print(
            f"{kind:9s}: sync {best.seconds:.3f} s ({best.gb_per_s:.2f} GB/s, {best.buckets} buckets, "
            f"peak extra {best.peak_extra_bytes / 2**20:.0f} MiB) | floor {floor_s:.3f} s "
            f"({total / 1e9 / floor_s:.2f} GB/s) | sync/floor throughput {floor_s / best.seconds:.2f} | "
            f"sync/{floor_name} {copy_s / best.seconds:.3f} | "
            f"first sync {r['first'].seconds:.3f} s | all syncs {[round(m.seconds, 3) for m in r['syncs']]} | "
            f"max |Δ log-prob| {r['gap']:.1e}"
        )
        figures[kind] = {
            "sync_s": best.seconds,
            "transport_floor_s": floor_s,
            "sync_over_transport_floor": floor_s / best.seconds,
            "sync_over_copy_floor": copy_s / best.seconds,
            "first_sync_s": r["first"].seconds,
            "max_log_prob_gap": r["gap"],
        }
    d = results["delta"]
    full, delta = d["full"], d["delta"]
    print(
        f"delta    : after changing 2 tensors, sent {delta.bytes / 1e6:.2f} MB ({delta.tensors} tensors, "
        f"{delta.bytes / full.bytes:.2%} of {full.bytes / 1e6:.1f} MB), skipped {delta.bytes_skipped / 1e6:.1f} MB, "
        f"{delta.seconds:.3f} s vs full {full.seconds:.3f} s | max |Δ log-prob| {d['gap']:.1e}"
    )
    figures["delta"] = {"bytes": delta.bytes, "seconds": delta.seconds, "full_seconds": full.seconds}
    return figures


def main() -> None:
    args = _parse()
    work = Path(tempfile.mkdtemp(prefix="megarl_bench_sync_"))
    servers: list = []
    try:
        if args.lora:
            figures = lora_sync.report(args, lora_sync.run(args, work))
        else:
            results, broadcast_backend = _run(args, work, servers)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if not args.lora:
        figures = _report(args, results, broadcast_backend)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
