"""Per-request async multi-turn rollout against the ideal, beside a lock-step batch-per-turn baseline.

N trajectories each make K tool calls, one per model turn (every turn is parsed as a call to a `sleep`
tool), then answer once more: K+1 model turns of `--tokens` tokens each (ignore_eos) from an
embedded engine serving tiny_dense with random weights. Each call sleeps a random latency, uniform in
[`--min-latency`, `--max-latency`] s, fixed per (trajectory, call) by `--seed`.

- async: `ToolAgentLoop.run` for every trajectory at once; each goes on as soon as its own tool answers.
- lock-step: every turn generates for all trajectories together, then waits for all their tool
  calls before the next turn (the slowest call of each turn gates everyone).
- ideal: the slowest trajectory's own serial time: the trajectories with the largest latency sums,
  each run alone through the same loop; the largest of those wall times.

Prints wall seconds and ideal ÷ wall for both (goal for async ≥ 0.8).

    .venv/bin/python bench/rollout.py [--trajectories 32 --calls 4 --tokens 16 --max-latency 2.0]
"""

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import start_engine
from transformers import AutoTokenizer

from megarl.agents.base import AgentContext, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.agents.tool_parsers import ParsedTurn, ToolCall
from megarl.agents.tools.base import BaseTool, ToolResult
from megarl.assets import asset_path
from megarl.config.rollout import MultiTurnConfig
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams

SCHEMA = {"type": "function", "function": {"name": "sleep", "parameters": {"type": "object"}}}


class EveryTurnCalls:
    """A parser that reads every model turn as one call to `sleep` (random-weight models emit no calls)."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content="", calls=[ToolCall(name="sleep", arguments={})])


class SleepTool(BaseTool):
    """Sleeps the latency planned for (trajectory, call number)."""

    def __init__(self, latencies: dict[str, list[float]]) -> None:
        super().__init__({}, SCHEMA)
        self.latencies = latencies
        self.calls: dict[str, int] = {}

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        trajectory = instance_id.split("/")[0]
        k = self.calls.get(trajectory, 0)
        self.calls[trajectory] = k + 1
        await asyncio.sleep(self.latencies[trajectory][k])
        return ToolResult(text=f"slept {self.latencies[trajectory][k]:.2f} s")


@dataclass(kw_only=True)
class Workload:
    url: str
    chat: ChatTokens
    prompt: list[int]
    latencies: dict[str, list[float]]
    """Planned tool latency per trajectory name and call."""
    calls: int
    tokens: int


def context(router: Router, w: Workload) -> AgentContext:
    return AgentContext(
        router=router,
        chat=w.chat,
        response_length=(w.calls + 1) * (w.tokens + 64),
        multi_turn=MultiTurnConfig(max_assistant_turns=w.calls + 1, max_new_tokens_per_turn=w.tokens),
        tools={"sleep": SleepTool(w.latencies)},
        parser=EveryTurnCalls(),
    )


async def run_async(w: Workload, names: list[str]) -> float:
    """Every trajectory through its own ToolAgentLoop run, all at once."""
    router = Router(Fleet.connect([w.url]).clients)
    loop = ToolAgentLoop(context(router, w))
    sampling = SamplingParams(ignore_eos=True)
    started = time.perf_counter()
    samples = [AgentSample(sample_id=n, prompt_ids=w.prompt, messages=[]) for n in names]
    outputs = await asyncio.gather(*(loop.run(sample, sampling) for sample in samples))
    wall = time.perf_counter() - started
    await router.close()
    assert all(o.num_turns == 2 * w.calls + 1 for o in outputs), [o.finish_reason for o in outputs]
    return wall


async def run_lockstep(w: Workload, names: list[str]) -> float:
    """Batch per turn: generate for all, then wait for all tool calls, then the next turn."""
    router = Router(Fleet.connect([w.url]).clients)
    sampling = SamplingParams(ignore_eos=True, max_new_tokens=w.tokens)
    contexts = {n: list(w.prompt) for n in names}
    started = time.perf_counter()
    for turn in range(w.calls + 1):
        results = await asyncio.gather(
            *(router.generate(contexts[n], sampling, return_logprob=True, trajectory_id=n) for n in names)
        )
        for n, [result] in zip(names, results, strict=True):
            contexts[n] += result.output_ids
        if turn == w.calls:
            break
        await asyncio.gather(*(asyncio.sleep(w.latencies[n][turn]) for n in names))
        for n in names:
            ended = contexts[n][-1] in w.chat.eos_ids
            contexts[n] += w.chat.delta([{"role": "tool", "content": f"slept {w.latencies[n][turn]:.2f} s"}], ended)
    wall = time.perf_counter() - started
    await router.close()
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4, help="tool calls per trajectory")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per model turn")
    parser.add_argument("--min-latency", type=float, default=0.1)
    parser.add_argument("--max-latency", type=float, default=2.0)
    parser.add_argument("--solo", type=int, default=2, help="slowest trajectories timed alone for the ideal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    names = [f"t{i}" for i in range(args.trajectories)]
    latencies = {n: [rng.uniform(args.min_latency, args.max_latency) for _ in range(args.calls)] for n in names}
    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    prompt = chat.encode(
        [{"role": "user", "content": "Call the sleep tool."}], add_generation_prompt=True, tools=[SCHEMA]
    )
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_engine(asset_path("models/tiny_dense"), Path(tmp), "--load-format", "dummy")
        try:
            w = Workload(url=url, chat=chat, prompt=prompt, latencies=latencies, calls=args.calls, tokens=args.tokens)
            asyncio.run(run_async(w, names[:2]))  # warm-up
            slowest = sorted(names, key=lambda n: -sum(latencies[n]))[: args.solo]
            solo = [asyncio.run(run_async(w, [n])) for n in slowest]
            async_wall = asyncio.run(run_async(w, names))
            lockstep_wall = asyncio.run(run_lockstep(w, names))
        finally:
            server.stop()
    ideal = max(solo)
    print(
        f"{args.trajectories} trajectories × {args.calls} tool calls ({args.min_latency}-{args.max_latency} s), "
        f"{args.calls + 1} turns × {args.tokens} tokens"
    )
    print(
        f"ideal (slowest trajectory alone)  {ideal:7.2f} s   "
        f"(its tool sleeps: {max(sum(latencies[n]) for n in names):.2f} s)"
    )
    print(
        f"async per-request rollout         {async_wall:7.2f} s   ideal/wall = {ideal / async_wall:.2f}  (goal >= 0.8)"
    )
    print(f"lock-step batch per turn          {lockstep_wall:7.2f} s   ideal/wall = {ideal / lockstep_wall:.2f}")
    print(f"async speed-up over lock-step     {lockstep_wall / async_wall:.2f}x")


if __name__ == "__main__":
    main()
