"""Embedded engine: decode throughput at batch 1 vs 16 (the batching gain), and the prefix cache's gain.

Starts the engine as a server process on the tiny dense model (random weights) and drives it
through the client, as the router does. Each round runs one request alone, then 16 at once, every
request generating `--tokens` tokens with ignore_eos; then the second turn of a conversation
(`--context` tokens so far + 8 new) answered with its first turn in the prefix cache and, after a
flush, without. Rounds alternate; the script prints medians and their ratios.

    .venv/bin/python bench/embedded_engine.py [--tokens 128] [--rounds 3] [--device cpu]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import randomize

from megarl.assets import asset_path
from megarl.engines.client.client import EngineClient
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.replicas.server_process import ServerProcess
from megarl.ports import free_port


async def tokens_per_s(client: EngineClient, batch: int, tokens: int) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(batch)]
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(r[0].output_ids) for r in results) / elapsed


async def second_turn_seconds(client: EngineClient, context: int, cached: bool) -> float:
    """Seconds to answer turn 2 (one token) of a conversation whose turn 1 filled `context` tokens."""
    first = [(7 * i) % 4000 + 1 for i in range(context - 16)]
    (turn1,) = await client.generate(first, SamplingParams(max_new_tokens=16, ignore_eos=True))
    if not cached:
        await client.flush_cache()
    start = time.perf_counter()
    (turn2,) = await client.generate(first + turn1.output_ids + [5] * 8, SamplingParams(max_new_tokens=1))
    elapsed = time.perf_counter() - start
    assert (turn2.cached_tokens > 0) == cached
    await client.flush_cache()
    return elapsed


async def measure(url: str, tokens: int, rounds: int, context: int) -> dict[str, list[float]]:
    client = Fleet.connect([url]).clients[0]
    await tokens_per_s(client, 4, 8)  # warm-up
    rates: dict[str, list[float]] = {"batch 1": [], "batch 16": [], "turn 2 cached": [], "turn 2 uncached": []}
    for _ in range(rounds):
        rates["batch 1"].append(await tokens_per_s(client, 1, tokens))
        rates["batch 16"].append(await tokens_per_s(client, 16, tokens))
        rates["turn 2 cached"].append(await second_turn_seconds(client, context, cached=True))
        rates["turn 2 uncached"].append(await second_turn_seconds(client, context, cached=False))
    await client.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=1024, help="tokens of the conversation before turn 2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        config = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_dense"))
        model = transformers.AutoModelForCausalLM.from_config(config)
        randomize(model, seed=0)
        model.save_pretrained(model_dir)
        port = free_port()
        command = [sys.executable, "-m", "megarl.engines.embedded", "--model-path", str(model_dir)]
        server = ServerProcess(
            [*command, "--port", str(port), "--device", args.device], log_path=Path(tmp) / "engine.log"
        )
        try:
            server.wait_healthy(f"http://127.0.0.1:{port}/health_generate", timeout_s=120)
            rates = asyncio.run(measure(f"http://127.0.0.1:{port}", args.tokens, args.rounds, args.context))
        finally:
            server.stop()
    med = {name: statistics.median(values) for name, values in rates.items()}
    print(f"embedded engine, tiny_dense on {args.device}, {args.tokens} new tokens per request, {args.rounds} rounds")
    for name in ("batch 1", "batch 16"):
        print(f"{name:>8}: {med[name]:8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in rates[name])})")
    print(f"batching gain (batch 16 ÷ batch 1): {med['batch 16'] / med['batch 1']:.2f}x")
    for name in ("turn 2 cached", "turn 2 uncached"):
        print(f"{name} ({args.context}-token context): {1e3 * med[name]:7.1f} ms")
    print(f"prefix cache gain on turn 2 (uncached ÷ cached time): {med['turn 2 uncached'] / med['turn 2 cached']:.2f}x")


if __name__ == "__main__":
    main()
