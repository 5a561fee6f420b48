"""Partial rollouts across a weight update, against a real embedded engine process: SGLang 0.5.23's three
pause modes, the router's resume of aborted samples, and the tool loop unchanged under each mode.

Every scenario starts a long greedy generation, waits until the engine has generated some of it, pauses,
updates the weights (new random ones by handle, or only the version label where the outputs must stay
comparable), continues, and checks which weights sampled which tokens.
"""

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import transformers
from cases.agent_cases import CHECK_SCHEMA, SYSTEM, CallEveryTurnParser
from cases.engine_cases import engine_client, hf_logprobs, load_hf, randomize, run, save_engine_model, start_engine
from transformers import AutoTokenizer

from megarl.agents.base import AgentContext, AgentLoop, AgentOutput, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.postprocess import to_batch
from megarl.agents.single_turn import SingleTurnAgentLoop
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.agents.tools.gsm8k import CheckAnswerTool
from megarl.assets import asset_path
from megarl.config.rollout import MultiTurnConfig
from megarl.engines.client.client import EngineClient, EngineError
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import PAUSE_MODES, GenerateResult, version_number
from megarl.engines.weights.tensor_handles import serialize_named_tensors

PROMPT = [5, 6, 7]
LONG = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
TURN_CAP, RESPONSE = 1000, 1300
"""The tool loop's per-turn cap and response budget: a long first turn to pause in, a shorter second one."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_model(tmp_path_factory.mktemp("partial") / "model", hidden=64, layers=2)


@pytest.fixture(scope="module")
def url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"))
    yield url
    server.stop()


async def _generated(client: EngineClient) -> int:
    return int((await client.server_info())["embedded_stats"]["generated_tokens"])


async def _wait_generating(client: EngineClient, before: int, rows: int = 1) -> None:
    """Until the engine holds `rows` sequences and has generated 20 tokens per row since `before` tokens."""
    while True:
        info = await client.server_info()
        if info["in_flight"] >= rows and info["embedded_stats"]["generated_tokens"] >= before + 20 * rows:
            return
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _paused(client: EngineClient, mode: str) -> AsyncIterator[None]:
    """Paused in `mode` for the block; continued after it, even when it fails (the next test needs the engine)."""
    await client.pause_generation(mode)
    try:
        yield
    finally:
        await client.continue_generation()


async def _next_version(client: EngineClient) -> tuple[int, str]:
    """The engine's version number now, and the tag of the next one."""
    number = version_number((await client.model_info())["weight_version"])
    return number, f"v{number + 1}"


async def _push(client: EngineClient, model: torch.nn.Module, version: str, flush_cache: bool = True) -> None:
    """Every weight of `model` by handle, in a weight-update session, tagged `version`."""
    named = [(name, t.detach().clone()) for name, t in model.state_dict().items()]
    await client.begin_weight_update()
    try:
        entry = serialize_named_tensors(named)
        await client.update_weights_from_tensor([entry], flush_cache=flush_cache, weight_version=version)
    finally:
        await client.end_weight_update()


def _new_weights(model_dir: Path, seed: int) -> transformers.PreTrainedModel:
    model = load_hf(model_dir)
    randomize(model, seed)
    return model


def _switch(result: GenerateResult, old: int) -> int:
    """Where the tokens of version `old` end; checks they are followed by version old + 1 to the end."""
    k = result.weight_versions[0].end
    assert 0 < k < len(result.output_ids), result.weight_versions
    assert result.token_versions() == [old] * k + [old + 1] * (len(result.output_ids) - k)
    return k


def _recomputed(result: GenerateResult, model: transformers.PreTrainedModel, k: int) -> torch.Tensor:
    """|engine - full forward of `model`| for the log-probs of the tokens after the first `k`."""
    expected = hf_logprobs(model, PROMPT + result.output_ids[:k], result.output_ids[k:])
    assert result.output_logprobs is not None
    return (torch.tensor(result.output_logprobs[k:]) - expected).abs()


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body) as resp:
        return resp.status, await resp.json()


def test_abort_returns_partial_outputs_and_the_router_resumes_them(url: str, model_dir: Path) -> None:
    new = _new_weights(model_dir, seed=101)
    body = {"input_ids": PROMPT, "sampling_params": LONG.to_json(), "return_logprob": True}

    async def scenario() -> tuple[int, tuple[int, dict], list[GenerateResult], bool, bool]:
        client, router = engine_client(url), Router([engine_client(url)], resume_aborted=True)
        old, version = await _next_version(client)
        before = await _generated(client)
        raw = asyncio.create_task(_post(url, body))
        resumed = asyncio.create_task(router.generate(PROMPT, dataclasses.replace(LONG, n=2), return_logprob=True))
        await _wait_generating(client, before, rows=3)
        async with _paused(client, "abort"):
            answered = raw.done()  # the pause drained first: it answers once the aborted calls have
            in_flight = (await client.server_info())["in_flight"]
            late = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=3)))
            await asyncio.sleep(0.3)
            gated = not late.done() and (await client.server_info())["in_flight"] == 0
            await _push(client, new, version)  # flush_cache=True succeeds: the abort left the engine idle
        results = await resumed
        assert len((await late)[0].output_ids) == 3
        await router.close()
        await client.close()
        return old, await raw, results, answered and in_flight == 0, gated

    old, (status, reply), results, drained, gated = run(scenario())
    assert drained, "the pause answered only after every aborted call had"
    assert gated, "a call made while paused waited at the gate, outside the engine"
    meta, partial = reply["meta_info"], len(reply["output_ids"])
    assert status == 200 and 0 < partial < LONG.max_new_tokens
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert len(meta["output_token_logprobs"]) == partial
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": partial}]
    assert len(results) == 2, "each of n=2 samples resumed on its own"
    for result in results:
        assert result.finish_reason.type == "length" and len(result.output_ids) == LONG.max_new_tokens
        assert result.num_resumes == 1
        k = _switch(result, old)
        assert float(_recomputed(result, new, k).max()) < 1e-4, "resumed: prompt + partial prefilled anew"


def test_retract_requeues_and_prefills_again_with_the_new_weights(url: str, model_dir: Path) -> None:
    new = _new_weights(model_dir, seed=102)

    async def scenario() -> tuple[int, bool, dict, GenerateResult]:
        client = engine_client(url)
        old, version = await _next_version(client)
        before = await _generated(client)
        running = asyncio.create_task(client.generate(PROMPT, LONG, return_logprob=True))
        await _wait_generating(client, before)
        async with _paused(client, "retract"):
            flushed = await client.flush_cache()
            await _push(client, new, version)  # flush_cache=True succeeds: the retracted request holds no KV
            info = await client.server_info()
        result = (await running)[0]
        await client.close()
        return old, flushed, info, result

    old, flushed, info, result = run(scenario())
    assert flushed, "retract frees the KV: the cache flushes although a request is queued"
    assert info["paused"] and info["in_flight"] == 1
    assert result.finish_reason.type == "length" and len(result.output_ids) == LONG.max_new_tokens
    assert result.num_retractions == 1
    k = _switch(result, old)
    assert float(_recomputed(result, new, k).max()) < 1e-4, "prompt + output prefilled again with the new weights"


def test_in_place_keeps_the_kv_and_a_flush_fails_softly(url: str, model_dir: Path) -> None:
    new = _new_weights(model_dir, seed=103)

    async def scenario() -> tuple[int, str, bool, str, int, str, GenerateResult]:
        client = engine_client(url)
        old, version = await _next_version(client)
        before = await _generated(client)
        running = asyncio.create_task(client.generate(PROMPT, LONG, return_logprob=True))
        await _wait_generating(client, before)
        async with _paused(client, "in_place"):
            steps = (await client.server_info())["embedded_stats"]["decode_steps"]
            flushed = await client.flush_cache()
            with pytest.raises(EngineError) as refused:
                await _push(client, new, version)  # flush_cache=True: the weights load, the flush is refused
            served = (await client.model_info())["weight_version"]
            held = (await client.server_info())["embedded_stats"]["decode_steps"] - steps
        result = (await running)[0]
        await client.close()
        return old, version, flushed, str(refused.value), held, served, result

    old, version, flushed, refused, held, served, result = run(scenario())
    assert not flushed and "not flushed" in refused and served == version
    assert held == 0, "no step ran while paused"
    assert result.finish_reason.type == "length" and len(result.output_ids) == LONG.max_new_tokens
    assert result.num_retractions == 0
    k = _switch(result, old)
    assert float(_recomputed(result, new, k).max()) > 1e-2, "decoding went on over the old weights' KV"


def test_the_routers_own_abort_is_not_resumed(url: str) -> None:
    async def scenario() -> GenerateResult:
        client, router = engine_client(url), Router([engine_client(url)], resume_aborted=True)
        before = await _generated(client)
        task = asyncio.create_task(router.generate(PROMPT, LONG, rid="stop-me"))
        await _wait_generating(client, before)
        await router.abort("stop-me")
        [result] = await task
        await router.close()
        await client.close()
        return result

    result = run(scenario())
    assert result.finish_reason.type == "abort" and result.num_resumes == 0
    assert 0 < len(result.output_ids) < LONG.max_new_tokens


@dataclasses.dataclass
class Loop:
    chat: ChatTokens
    sample: AgentSample
    reference: AgentOutput
    """The same trajectory with no pause."""


def _agent_loop(url: str, chat: ChatTokens, cls: type[AgentLoop] = ToolAgentLoop) -> tuple[AgentLoop, Router]:
    """An agent loop on a router that resumes aborted requests, its tools called every turn."""
    router = Router([engine_client(url)], resume_aborted=True)
    context = AgentContext(
        router=router,
        chat=chat,
        response_length=RESPONSE,
        multi_turn=MultiTurnConfig(max_new_tokens_per_turn=TURN_CAP),
        tools={"check_answer": CheckAnswerTool({}, CHECK_SCHEMA)},
        parser=CallEveryTurnParser(),
    )
    return cls(context), router


@pytest.fixture(scope="module")
def loop(url: str, model_dir: Path) -> Loop:
    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    messages = [SYSTEM, {"role": "user", "content": "What is 3 + 4?"}]
    sample = AgentSample(
        sample_id="traj",
        prompt_ids=chat.encode(messages, add_generation_prompt=True, tools=[CHECK_SCHEMA]),
        messages=messages,
        tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "7"}}},
    )

    async def reference() -> AgentOutput:
        client = engine_client(url)
        await _push(client, load_hf(model_dir), (await _next_version(client))[1])  # whatever ran before
        await client.close()
        tool_loop, router = _agent_loop(url, chat)
        out = await tool_loop.run(dataclasses.replace(sample, sample_id="reference"), LONG)
        await router.close()
        return out

    return Loop(chat=chat, sample=sample, reference=run(reference()))


@pytest.mark.parametrize("mode", PAUSE_MODES)
def test_tool_loop_runs_unchanged_across_a_pause(url: str, loop: Loop, mode: str) -> None:
    async def scenario() -> tuple[int, AgentOutput]:
        client = engine_client(url)
        old, version = await _next_version(client)
        before = await _generated(client)
        tool_loop, router = _agent_loop(url, loop.chat)
        task = asyncio.create_task(tool_loop.run(dataclasses.replace(loop.sample, sample_id=mode), LONG))
        await _wait_generating(client, before)
        async with _paused(client, mode):
            await client.update_weight_version(version)  # the same weights: the trajectory must not change
        out = await task
        await router.close()
        await client.close()
        return old, out

    old, out = run(scenario())
    ref = loop.reference
    assert out.response_ids == ref.response_ids and out.response_mask == ref.response_mask
    assert out.num_turns == ref.num_turns == 3 and out.finish_reason == ref.finish_reason
    logprobs, ref_logprobs = torch.tensor(out.response_logprobs), torch.tensor(ref.response_logprobs)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
    assert out.metrics["num_resubmits"] == (1.0 if mode == "abort" else 0.0)
    assert out.response_versions is not None
    k = out.response_versions.index(old + 1)
    assert 0 < k < TURN_CAP, "the pause fell inside the first turn"
    want = [-1 if not m else old if i < k else old + 1 for i, m in enumerate(out.response_mask)] + [-1] * 8
    versions = to_batch([out], len(loop.sample.prompt_ids), RESPONSE + 8, pad_token_id=0)["rollout_versions"][0]
    assert versions.dtype == torch.int64 and versions.tolist() == want


def test_single_turn_loop_is_resumed_across_an_abort(url: str, loop: Loop) -> None:
    async def scenario() -> tuple[int, AgentOutput]:
        client = engine_client(url)
        old, version = await _next_version(client)
        before = await _generated(client)
        single, router = _agent_loop(url, loop.chat, SingleTurnAgentLoop)
        task = asyncio.create_task(single.run(dataclasses.replace(loop.sample, sample_id="single"), LONG))
        await _wait_generating(client, before)
        async with _paused(client, "abort"):
            await client.update_weight_version(version)
        out = await task
        await router.close()
        await client.close()
        return old, out

    old, out = run(scenario())
    assert len(out.response_ids) == RESPONSE and out.finish_reason == "length"
    assert out.metrics["num_resubmits"] == 1.0
    versions = to_batch([out], len(loop.sample.prompt_ids), RESPONSE, pad_token_id=0)["rollout_versions"][0].tolist()
    k = versions.index(old + 1)
    assert k > 0 and versions == [old] * k + [old + 1] * (RESPONSE - k)
