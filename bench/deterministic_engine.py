"""The cost of `--enable-deterministic-inference` in the embedded engine: seconds to generate one step's worth of
samples with continuous batching vs with every sequence decoded alone (megarl/engines/embedded/row_batch.py).

Two engines run in this process on the same random model (tiny_dense, the CPU demo's size, or `--hidden`/`--layers`
for a wider one). Each round submits `--requests` seeded requests of `--prompt` prompt tokens generating `--tokens`
tokens each to one engine, then to the other, alternating which goes first; the script prints the median seconds
of each and their ratio, and checks both gave the same tokens.

    .venv/bin/python bench/deterministic_engine.py [--requests 128] [--prompt 40] [--tokens 3] [--rounds 5]
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import save_engine_model

from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.sampler import RowSampling


def run_round(engine: EmbeddedEngine, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds until every request finished, and their outputs in submission order."""
    done: dict[str, Sequence] = {}
    finished = threading.Event()

    def collect(seq: Sequence) -> None:
        done[seq.rid] = seq
        if len(done) == len(prompts):
            finished.set()

    seqs = [
        Sequence(
            rid=str(i),
            prompt=prompt,
            sampling=RowSampling(temperature=1.0, top_p=1.0, top_k=-1, generator=torch.Generator().manual_seed(i)),
            max_new_tokens=tokens,
            stop_ids=frozenset(),
        )
        for i, prompt in enumerate(prompts)
    ]
    start = time.perf_counter()
    engine.submit(seqs, collect)
    assert finished.wait(600)
    return time.perf_counter() - start, [done[str(i)].output for i in range(len(prompts))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = save_engine_model(Path(tempfile.mkdtemp()) / "model", hidden=args.hidden, layers=args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    engines = {
        name: EmbeddedEngine(EngineArgs(model_path=str(model), enable_deterministic_inference=flag))
        for name, flag in (("batched", False), ("deterministic", True))
    }
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for r in range(args.rounds):
            for name in sorted(engines, reverse=bool(r % 2)):
                elapsed, outputs[name] = run_round(engines[name], prompts, args.tokens)
                seconds[name].append(elapsed)
    finally:
        for engine in engines.values():
            engine.shutdown()
    same = sum(a == b for a, b in zip(outputs["batched"], outputs["deterministic"], strict=True))
    batched, deterministic = (statistics.median(seconds[name]) for name in ("batched", "deterministic"))
    print(f"{args.requests} requests × {args.tokens} tokens, prompt {args.prompt}, model h{args.hidden}×{args.layers}")
    print(f"batched (continuous batching): {batched:.3f} s   deterministic (one row each): {deterministic:.3f} s")
    print(f"deterministic / batched: {deterministic / batched:.2f}×   same tokens: {same}/{args.requests} requests")


if __name__ == "__main__":
    main()
