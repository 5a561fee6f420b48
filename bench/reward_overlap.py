"""Scoring as trajectories finish vs after the batch, with a slow reward, side by side in one run.

One agent worker (`megarl.agents.worker.AgentWorker`, in this process) rolls out `--prompts` × `--n` GSM8K samples
on an embedded engine serving tiny_dense (random weights) through `slow_reward.VariedLengthLoop` (each sample's
length drawn, seeded: lognormal around a quarter of `--tokens`, so samples finish at different times), and scores
them with `slow_reward.score`: the GSM8K rule after a seeded wait of about `--seconds` per
sample (uniform in ±50%, fixed per response), in `reward.num_workers` processes.

- as they finish (`reward.overlap=true`): each trajectory is scored the moment its loop ends, while the others
  still generate;
- after the batch (`reward.overlap=false`): generation, then scoring: generation + scoring, serially;
- generation alone (an instant reward): the floor, which gives the best ratio these lengths allow.

Each mode runs `--repeats` times, alternating; prints the median wall seconds and overlap ÷ after-batch
(goal ≤ 0.6), and checks both modes gave the same scores.

    .venv/bin/python bench/reward_overlap.py [--prompts 16 --n 4 --seconds 0.2 --workers 10]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases.engine_cases import start_engine
from transformers import AutoTokenizer

from megarl.agents.worker import AgentSettings, AgentWorker
from megarl.assets import asset_path
from megarl.batch import Batch
from megarl.config.reward import RewardModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.trainer import RewardConfig
from megarl.scoring.pipeline import RewardSettings

QUESTIONS = [f"What is {a} plus {b}? Answer after ####." for a in range(3, 9) for b in range(2, 6)]


def prompt_rows(tokenizer: AutoTokenizer, prompts: int, n: int) -> Batch:
    """`prompts` GSM8K-shaped rows, each repeated `n` times (one uid per prompt)."""
    messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(prompts)]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    rows = [i for i in range(prompts) for _ in range(n)]
    return Batch.from_dict(
        {},
        {
            "raw_prompt_ids": [list(ids[i]) for i in rows],
            "raw_prompt": [messages[i] for i in rows],
            "data_source": ["openai/gsm8k"] * len(rows),
            "reward_model": [{"ground_truth": "7"}] * len(rows),
            "extra_info": [{}] * len(rows),
            "uid": [f"p{i}" for i in rows],
        },
    )


def worker(url: str, overlap: bool, seconds: float, workers: int, response_length: int) -> AgentWorker:
    reward = RewardConfig(function="slow_reward:score", kwargs={"seconds": seconds}, overlap=overlap)
    reward.num_workers = workers
    settings = AgentSettings(
        rollout=RolloutConfig(temperature=1.0, default_agent="slow_reward:VariedLengthLoop"),
        tokenizer_path=str(asset_path("tokenizer")),
        prompt_length=128,
        response_length=response_length,
        rewards=RewardSettings(reward=reward, models=RewardModelConfig()),
    )
    return AgentWorker(settings, [url])


async def timed(agent: AgentWorker, rows: Batch) -> tuple[float, list[float]]:
    started = time.perf_counter()
    out, _ = await agent.rollout_rows(rows, validate=False, seed=7, first_row=0)
    return time.perf_counter() - started, out["scores"].tolist()


async def compare(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rows = prompt_rows(AutoTokenizer.from_pretrained(asset_path("tokenizer")), args.prompts, args.n)
    seconds = {mode: 0.0 if mode == "generation" else args.seconds for mode in MODES}
    agents = {mode: worker(url, mode != "after_batch", seconds[mode], args.workers, args.tokens) for mode in MODES}
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    scores: dict[str, list[float]] = {}
    try:
        for agent in agents.values():  # warm-up: the reward processes start
            await timed(agent, rows[: args.workers])
        for _ in range(args.repeats):
            for mode, agent in agents.items():
                wall, scores[mode] = await timed(agent, rows)
                walls[mode].append(wall)
    finally:
        for agent in agents.values():
            await agent.close()
    if scores["overlap"] != scores["after_batch"]:
        raise SystemExit(f"the modes scored differently: {scores}")
    return walls


MODES = ("overlap", "after_batch", "generation")
"""`generation`: the same rollout with an instant reward, the floor under both."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_engine(asset_path("models/tiny_dense"), Path(tmp), "--load-format", "dummy")
        try:
            walls = asyncio.run(compare(url, args))
        finally:
            server.stop()
    median = {mode: statistics.median(walls[mode]) for mode in MODES}
    samples = args.prompts * args.n
    print(f"{samples} samples, ~{args.seconds} s of scoring each on {args.workers} reward processes")
    for mode in MODES:
        runs = [round(w, 2) for w in walls[mode]]
        print(f"{mode:>12}: median wall {median[mode]:.2f} s over {args.repeats} runs {runs}")
    print(f"overlap ÷ after-batch (generation + scoring serially): {median['overlap'] / median['after_batch']:.2f}")
    floor = max(median["generation"] + 1.5 * args.seconds, median["after_batch"] - median["generation"])
    print(
        f"bound for these lengths: (generation + the last trajectory's own scoring, at most 1.5 × {args.seconds} s) "
        f"or the scoring alone, whichever is longer, ÷ after-batch: {floor / median['after_batch']:.2f}"
    )


if __name__ == "__main__":
    main()
