"""Per-request overhead of the OpenAI-compatible session server over a direct engine call, at N concurrent sessions.

An embedded engine serves tiny_dense (random weights). Every session is an agent written against the `openai`
client (`agent` below): K chat completions of `--tokens` tokens each (ignore_eos), a user message between them, all
sessions at once through `OpenAIAgentLoop` (HTTP client → session server → router → engine). Then the same
requests' input ids, recorded on the way, are sent straight to the router with the same concurrency.

Per request: overhead = the latency the agent saw − the router call the server made for it (timed around
`Router.generate`), i.e. what the openai client's request building and parsing, the server's parsing, the template
delta, the tool-call parse and the JSON answer add, with every session's work on the one event loop. Prints p50/p90
of both paths' latencies and of the overhead (goal: overhead p50 ≤ 5 ms on CPU), the server's own part of it (its
handler time outside the router call, per request, by session), and the overhead when the agents' clients go
over HTTP instead (`agents.openai.in_process=false`, as an agent in another process would).

    .venv/bin/python bench/openai_server.py [--sessions 64 --turns 4 --tokens 8]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases.engine_cases import start_engine
from transformers import AutoTokenizer

from megarl.agents.base import AgentContext, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.openai.loop import OpenAIAgentLoop
from megarl.assets import asset_path
from megarl.config.agents import OpenAIAgentConfig
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult

TURNS, TOKENS = 4, 8
SEEN: dict[str, float] = {}
"""rid → the latency the agent saw for that request."""


class TimingRouter(Router):
    """A router that times each call and keeps its input ids, by request id."""

    def __init__(self, url: str) -> None:
        super().__init__(Fleet.connect([url]).clients)
        self.seconds: dict[str, float] = {}
        self.inputs: dict[str, list[int]] = {}

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *args: Any, **kw: Any
    ) -> list[GenerateResult]:
        started = time.perf_counter()
        results = await super().generate(input_ids, sampling, *args, **kw)
        rid = kw["rid"]
        self.seconds[rid], self.inputs[rid] = time.perf_counter() - started, list(input_ids)
        return results


async def agent(client: Any, sample: dict[str, Any]) -> None:
    """TURNS completions, a user message after each; records each request's latency."""
    messages = list(sample["messages"])
    for turn in range(TURNS):
        started = time.perf_counter()
        response = await client.chat.completions.create(model="any", messages=messages, max_tokens=TOKENS)
        SEEN[f"{sample['sample_id']}-{turn}"] = time.perf_counter() - started
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]


async def through_server(
    url: str, chat: ChatTokens, sessions: int, in_process: bool = True
) -> tuple[TimingRouter, list[float]]:
    """The agents through the server; the router (its timings) and each session's server seconds per request."""
    router = TimingRouter(url)
    context = AgentContext(
        router=router,
        chat=chat,
        prompt_length=256,
        response_length=(TOKENS + 32) * TURNS,
        openai=OpenAIAgentConfig(agent="__main__:agent", max_turns=TURNS, in_process=in_process),
    )
    loop = OpenAIAgentLoop(context)
    prompt = [{"role": "user", "content": "Tell me a story."}]
    samples = [
        AgentSample(sample_id=uuid.uuid4().hex, prompt_ids=chat.encode(prompt, True), messages=prompt)
        for _ in range(sessions)
    ]
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    try:
        outs = await asyncio.gather(*(loop.run(sample, sampling) for sample in samples))
    finally:
        await loop.close()
        await router.close()
    assert all(out.finish_reason == "length" and sum(out.response_mask) == TOKENS * TURNS for out in outs)
    return router, [out.metrics["openai/server_seconds"] / TURNS for out in outs]


async def direct(url: str, inputs: dict[str, list[int]], sessions: int) -> list[float]:
    """The same requests straight to a router: per session, its turns in order; sessions at once."""
    router = Router(Fleet.connect([url]).clients)
    sampling = SamplingParams(temperature=1.0, ignore_eos=True, max_new_tokens=TOKENS)
    by_session: dict[str, list[tuple[int, list[int]]]] = {}
    for rid, ids in inputs.items():
        sid, turn = rid.rsplit("-", 1)
        by_session.setdefault(sid, []).append((int(turn), ids))
    latencies: list[float] = []

    async def session(sid: str) -> None:
        for _, ids in sorted(by_session[sid]):
            started = time.perf_counter()
            await router.generate(ids, sampling, return_logprob=True, trajectory_id=sid)
            latencies.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(session(sid) for sid in by_session))
    finally:
        await router.close()
    return latencies


def _line(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return f"{name:<58} p50 {statistics.median(ms):8.2f} ms   p90 {p90:8.2f} ms   max {ms[-1]:8.2f} ms"


def main() -> None:
    global TURNS, TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()
    TURNS, TOKENS = args.turns, args.tokens
    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_engine(asset_path("models/tiny_dense"), Path(tmp), "--load-format", "dummy")
        try:
            asyncio.run(through_server(url, chat, 4))  # warm-up: imports, connections, the engine's first batches
            SEEN.clear()
            router, server_seconds = asyncio.run(through_server(url, chat, args.sessions))
            straight = asyncio.run(direct(url, router.inputs, args.sessions))
            seen_in_process = dict(SEEN)
            SEEN.clear()
            http_router, _ = asyncio.run(through_server(url, chat, args.sessions, in_process=False))
        finally:
            server.stop()
    seen = seen_in_process
    overhead = [seen[rid] - router.seconds[rid] for rid in seen]
    over_http = [SEEN[rid] - http_router.seconds[rid] for rid in SEEN]
    print(f"{args.sessions} sessions × {TURNS} turns × {TOKENS} tokens = {len(seen)} requests, one engine")
    print(_line("through the session server (openai client, in process)", list(seen.values())))
    print(_line("direct router calls, the same input ids", straight))
    print(_line("overhead: client latency − its router call", overhead))
    print(_line("  of which the server's handler outside the router call", server_seconds))
    print(_line("overhead over HTTP (agents.openai.in_process=false)", over_http))
    ratio = statistics.median(seen.values()) / statistics.median(straight)
    print(f"p50 latency ratio, server (in process) ÷ direct: {ratio:.3f}")


if __name__ == "__main__":
    main()
