"""The `rm` source's pieces without an engine: `rm_token_ids` (the RM's chat template, no generation prompt, the last
max_length tokens) and `ClassifierSource`'s requests against a stub `/classify` server in this process (retries on
5xx and 429, none on another 4xx, round robin, the concurrency bound, the key)."""

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import transformers
from aiohttp import web

from megarl.assets import asset_path
from megarl.config.reward import DiscriminativeRMConfig, RetryConfig
from megarl.engines.client.auth import EngineKeys
from megarl.ports import free_port
from megarl.rewards.formatting import rm_token_ids
from megarl.rewards.sources import Component, RewardSourceError, Trajectory
from megarl.scoring.classify import ClassifierSource

TOKENIZER = str(asset_path("tokenizer"))
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER)


def test_rm_token_ids_render_the_template_and_keep_the_last_tokens(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    whole = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False)["input_ids"]
    assert tokenizer.decode(whole).endswith("<|im_start|>assistant\nIt is 5.<|im_end|>\n")  # no generation prompt
    assert rm_token_ids(tokenizer, MESSAGES, 4096, {}) == whole
    assert rm_token_ids(tokenizer, MESSAGES, 7, {}) == whole[-7:]
    assert rm_token_ids(tokenizer, MESSAGES, len(whole), {}) == whole
    with_tools = rm_token_ids(tokenizer, MESSAGES, 4096, {"tools": TOOLS})  # kwargs reach the template
    assert len(with_tools) > len(whole) and with_tools[-12:] == whole[-12:]
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        rm_token_ids(tokenizer, MESSAGES, 0, {})


Reply = Callable[[web.Request], web.Response]


@asynccontextmanager
async def stub(
    replies: list[Reply], seen: list[dict[str, Any]], in_flight: list[int] | None = None
) -> AsyncIterator[str]:
    """A `/classify` server answering with `replies` in turn (the last one from then on), recording each request's
    key, body and the requests in flight (counted in `in_flight`, which stubs may share) when it arrived."""
    in_flight = [0] if in_flight is None else in_flight

    async def classify(request: web.Request) -> web.Response:
        in_flight[0] += 1
        seen.append({"auth": request.headers.get("Authorization"), "body": await request.json(), "busy": in_flight[0]})
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        return replies[min(len(seen), len(replies)) - 1](request)

    app = web.Application()
    app.router.add_post("/classify", classify)
    runner, port = web.AppRunner(app), free_port()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def ok(score: float) -> Reply:
    reply = {"embedding": [score], "meta_info": {"id": "x", "prompt_tokens": 3}}
    return lambda request: web.json_response(reply)


def status(code: int) -> Reply:
    return lambda request: web.json_response({"error": {"message": f"status {code}"}}, status=code)


def _cfg(concurrency: int = 8, max_retries: int = 3) -> DiscriminativeRMConfig:
    retry = RetryConfig(timeout_s=5.0, max_retries=max_retries, backoff_s=0.01, max_backoff_s=0.02)
    return DiscriminativeRMConfig(enable=True, path=TOKENIZER, backend="server", concurrency=concurrency, retry=retry)


def _trajectory(i: int = 0) -> Trajectory:
    return Trajectory("t", MESSAGES, MESSAGES[:1], "It is 5.", "5", sample_id=f"s{i}")


async def _scores(cfg: DiscriminativeRMConfig, urls: list[str], count: int, keys: Any = None) -> list[Component]:
    source = ClassifierSource(cfg, urls, keys)
    try:
        return list(await asyncio.gather(*(source.score(_trajectory(i)) for i in range(count))))
    finally:
        await source.close()


async def _retried(replies: list[Reply], cfg: DiscriminativeRMConfig) -> tuple[list[Component], list[dict]]:
    seen: list[dict[str, Any]] = []
    async with stub(replies, seen) as url:
        return await _scores(cfg, [url], 1, EngineKeys(api="api", admin="admin")), seen


def test_5xx_and_429_are_tried_again_with_the_api_key(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    components, seen = asyncio.run(_retried([status(503), status(429), status(500), ok(1.5)], _cfg()))
    assert components == [Component(value=1.5, retries=3)]
    ids = rm_token_ids(tokenizer, MESSAGES, 4096, {})
    assert [s["body"] for s in seen] == [{"input_ids": ids}] * 4  # the RM's tokens, one prompt, no rid
    assert {s["auth"] for s in seen} == {"Bearer api"}  # /classify is a NORMAL endpoint: the api key


def test_other_4xx_fail_at_once_and_tries_are_bounded() -> None:
    with pytest.raises(RewardSourceError, match="HTTP 400") as refused:
        asyncio.run(_retried([status(400), ok(1.0)], _cfg()))
    assert refused.value.retries == 0
    with pytest.raises(RewardSourceError, match="failed 3 time") as exhausted:
        asyncio.run(_retried([status(502)], _cfg(max_retries=2)))
    assert exhausted.value.retries == 2
    with pytest.raises(RewardSourceError, match="not a /classify reply"):  # a 200 without an embedding
        asyncio.run(_retried([lambda request: web.json_response({"text": "?"})], _cfg(max_retries=0)))


async def _two_servers(cfg: DiscriminativeRMConfig, count: int) -> tuple[list[Component], list[dict], list[dict]]:
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    in_flight = [0]  # on both servers together
    async with stub([ok(1.0)], first, in_flight) as a, stub([ok(2.0)], second, in_flight) as b:
        return await _scores(cfg, [a, b + "/"], count), first, second


def test_round_robin_within_the_concurrency_bound() -> None:
    components, first, second = asyncio.run(_two_servers(_cfg(concurrency=2), 8))
    assert len(first) == len(second) == 4 and sorted(c.value for c in components) == [1.0] * 4 + [2.0] * 4
    assert max(s["busy"] for s in first + second) == 2  # two in flight at most
    assert {s["auth"] for s in first} == {None}  # no keys, no header
    _, first, second = asyncio.run(_two_servers(_cfg(concurrency=8), 8))
    assert max(s["busy"] for s in first + second) > 2  # the bound is what held them back
