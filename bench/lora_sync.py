"""`bench/sync.py --lora RANK`: LoRA's two syncs side by side on the tiny dense model (TP `--tp`).

A LoRA actor (rank RANK, every projection) trains a step and syncs twice into two embedded engines: its adapter into
one started with --enable-lora (`actor.lora.sync=adapter`), its merged weights into a plain one (`sync=merged`).
Prints each sync's bytes and seconds, adapter ÷ merged bytes after the first sync (which carries the base too), and
each engine's max |Δ log-prob| against the trainer on its own samples (the adapter engine's naming the adapter).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import start_engine
from cases.lora_cases import rank_lora_sync_twice
from cases.megatron_cases import layout, save_asset_model

from megarl.engines.replicas.launch import LoraServing
from megarl.megatron.launch import spawn


def run(args: argparse.Namespace, work: Path) -> dict:
    model_dir = save_asset_model("tiny_dense", work / "tiny_dense")
    serving = LoraServing(max_rank=args.lora, target_modules=("all-linear",))
    started = [start_engine(model_dir, work, "--load-format", "dummy", *flags) for flags in (serving.flags, ())]
    try:
        (_, adapter_url), (_, merged_url) = started
        return spawn(
            rank_lora_sync_twice, args.tp, model_dir, layout(args.tp, tp=args.tp), adapter_url, merged_url, args.lora
        )[0]
    finally:
        for server, _ in started:
            server.stop()


def report(args: argparse.Namespace, out: dict) -> dict:
    """Prints the figures; returns them as plain numbers."""
    figures: dict = {"rank": args.lora, "tp": args.tp}
    for round_ in (1, 2):
        adapter, merged = out[f"{round_}/adapter/metrics"], out[f"{round_}/merged/metrics"]
        ratio = adapter.bytes / merged.bytes
        print(
            f"sync {round_}: adapter {adapter.bytes / 1e6:.3f} MB in {adapter.seconds:.3f} s | merged "
            f"{merged.bytes / 1e6:.3f} MB in {merged.seconds:.3f} s | adapter/merged bytes {ratio:.4f} | max |Δ "
            f"log-prob| adapter {out[f'{round_}/adapter']:.1e}, merged {out[f'{round_}/merged']:.1e} (base: "
            f"{out[f'{round_}/adapter_off']:.2f})"
        )
        figures[f"sync{round_}"] = {"adapter_bytes": adapter.bytes, "merged_bytes": merged.bytes, "ratio": ratio}
    return figures
