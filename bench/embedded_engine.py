"""Embedded engine decode throughput: batch 1 vs batch 16 concurrent requests (the batching gain).

Starts the engine as a server process on the tiny dense model (random weights) and drives it
through the client, as the router does. Each round runs one request alone, then 16 at once, every
request generating `--tokens` tokens with ignore_eos; rounds alternate and the script prints
median tokens/s of each and their ratio.

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

from engine_cases import randomize

from megarl.assets import asset_path
from megarl.rollout.client import EngineClient
from megarl.rollout.sampling import SamplingParams
from megarl.rollout.server_process import ServerProcess, free_port


async def tokens_per_s(client: EngineClient, batch: int, tokens: int) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(batch)]
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(r[0].output_ids) for r in results) / elapsed


async def measure(url: str, tokens: int, rounds: int) -> dict[int, list[float]]:
    client = EngineClient(url)
    await tokens_per_s(client, 4, 8)  # warm-up
    rates: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(rounds):
        for batch in rates:
            rates[batch].append(await tokens_per_s(client, batch, tokens))
    await client.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        config = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_dense"))
        model = transformers.AutoModelForCausalLM.from_config(config)
        randomize(model, seed=0)
        model.save_pretrained(model_dir)
        port = free_port()
        command = [sys.executable, "-m", "megarl.rollout.embedded", "--model-path", str(model_dir)]
        server = ServerProcess(
            [*command, "--port", str(port), "--device", args.device], log_path=Path(tmp) / "engine.log"
        )
        try:
            server.wait_healthy(f"http://127.0.0.1:{port}/health_generate", timeout_s=120)
            rates = asyncio.run(measure(f"http://127.0.0.1:{port}", args.tokens, args.rounds))
        finally:
            server.stop()
    one, sixteen = statistics.median(rates[1]), statistics.median(rates[16])
    print(f"embedded engine, tiny_dense on {args.device}, {args.tokens} new tokens per request, {args.rounds} rounds")
    print(f"batch  1: {one:8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in rates[1])})")
    print(f"batch 16: {sixteen:8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in rates[16])})")
    print(f"batching gain (batch 16 ÷ batch 1): {sixteen / one:.2f}x")


if __name__ == "__main__":
    main()
