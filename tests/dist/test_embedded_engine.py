"""The embedded engine as a separate process, driven only through the SGLang-protocol client."""

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest
import torch
from cases.engine_cases import (
    engine_client,
    hf_greedy,
    hf_logprobs,
    load_hf,
    randomize,
    run,
    save_engine_model,
    start_engine,
)

from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.sampler import RowSampling
from megarl.engines.replicas.server_process import ServerProcess
from megarl.engines.weights.tensor_handles import serialize_flattened_bucket, serialize_named_tensors
from megarl.engines.weights.weight_group import broadcast, close_weight_group, flat_offsets, init_weight_group
from megarl.ports import free_port

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [42]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_model(tmp_path_factory.mktemp("engine") / "model")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    server, url = start_engine(
        model_dir, tmp_path_factory.mktemp("logs"), "--enable-weights-cpu-backup", "--max-running-requests", "16"
    )
    yield server, url
    server.stop()


async def _generate_all(url: str, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateResult]:
    client = engine_client(url)
    try:
        results = await asyncio.gather(*(client.generate(p, sampling, return_logprob=True) for p in prompts))
    finally:
        await client.close()
    return [r[0] for r in results]


def test_greedy_matches_transformers_generate(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    results = run(_generate_all(engine[1], PROMPTS, GREEDY))
    hf = load_hf(model_dir)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_ids == hf_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert result.finish_reason.type == "length" and result.finish_reason.length == GREEDY.max_new_tokens
        assert result.prompt_tokens == len(prompt)


def test_logprobs_equal_log_softmax_at_sampling_temperature(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True)
    results = run(_generate_all(engine[1], PROMPTS, sampling))
    hf = load_hf(model_dir)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_logprobs is not None and len(result.output_logprobs) == 16
        expected = hf_logprobs(hf, prompt, result.output_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-5, rtol=0)


def test_concurrent_requests_are_batched_and_seeds_do_not_depend_on_batching(engine: tuple[ServerProcess, str]) -> None:
    url = engine[1]

    async def scenario() -> tuple[list[GenerateResult], list[GenerateResult], dict]:
        client = engine_client(url)
        seeded = [SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=100 + i) for i in range(8)]
        alone = [(await client.generate(PROMPTS[i % 3], seeded[i]))[0] for i in range(2)]
        together = await asyncio.gather(*(client.generate(PROMPTS[i % 3], seeded[i]) for i in range(8)))
        info = await client.server_info()
        await client.close()
        return alone, [r[0] for r in together], info

    alone, together, info = run(scenario())
    assert [r.output_ids for r in alone] == [r.output_ids for r in together[:2]]
    histogram = {int(k): v for k, v in info["embedded_stats"]["batch_size_histogram"].items()}
    assert info["embedded_stats"]["max_batch_size"] >= 4, histogram
    assert sum(v for k, v in histogram.items() if k > 1) > 0


def test_n_samples_stop_tokens_and_batch_inputs(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    hf = load_hf(model_dir)
    greedy = hf_greedy(hf, PROMPTS[0], 12)
    stop = greedy[4]

    async def scenario() -> tuple[list[GenerateResult], list[GenerateResult]]:
        client = engine_client(engine[1])
        stopped = await client.generate(
            PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop])
        )
        samples = await client.generate(
            PROMPTS[1], SamplingParams(max_new_tokens=5, n=3, sampling_seed=7, ignore_eos=True)
        )
        await client.close()
        return stopped, samples

    stopped, samples = run(scenario())
    assert stopped[0].output_ids == greedy[: greedy.index(stop) + 1]
    assert stopped[0].finish_reason.type == "stop" and stopped[0].finish_reason.matched == stop
    assert len(samples) == 3 and len({r.rid for r in samples}) == 3
    assert all(len(r.output_ids) == 5 for r in samples)
    assert len({tuple(r.output_ids) for r in samples}) > 1


def test_bad_requests_get_clear_errors(engine: tuple[ServerProcess, str]) -> None:
    async def error_of(prompt: list[int], sampling: SamplingParams) -> str:
        client = engine_client(engine[1])
        try:
            with pytest.raises(EngineError) as info:
                await client.generate(prompt, sampling)
        finally:
            await client.close()
        return str(info.value)

    assert "max_new_tokens" in run(error_of([1] * 2000, SamplingParams(max_new_tokens=100)))
    assert "context length" in run(error_of([1] * 2048, SamplingParams(max_new_tokens=1)))
    assert "top_p" in run(error_of([1], SamplingParams(top_p=0.0)))
    assert "non-empty" in run(error_of([], SamplingParams()))
    assert "outside the model's vocabulary [0, 4096)" in run(error_of([5000], SamplingParams()))
    with pytest.raises(ValueError, match="sampling_seed"):  # the client checks payloads before sending
        run(engine_client(engine[1]).generate([1], SamplingParams(extra={"seed": 3})))


def test_server_rejects_fields_sglang_does_not_define(engine: tuple[ServerProcess, str]) -> None:
    async def post(body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.post(engine[1] + "/generate", json=body) as resp:
            return resp.status, await resp.text()

    assert run(post({"input_ids": [1], "sampling_params": {"seed": 1}}))[0] == 400
    status, text = run(post({"input_ids": [1], "sampling_params": {}, "temperature": 0.5}))
    assert status == 400 and "temperature" in text
    status, text = run(post({"text": "hi"}))
    assert status == 400 and "input_ids" in text


def test_routed_experts_need_the_launch_flag(engine: tuple[ServerProcess, str]) -> None:
    """Without --enable-return-routed-experts there is no capturer and no meta_info.routed_experts (SGLang's
    routed_experts.py::RoutedExpertsCapturer.create), but routed_experts_start_len is checked all the same."""

    async def scenario() -> tuple[GenerateResult, str]:
        client = engine_client(engine[1])
        [result] = await client.generate(PROMPTS[0], SamplingParams(max_new_tokens=2), return_routed_experts=True)
        with pytest.raises(EngineError) as refused:
            await client.generate([1, 2], SamplingParams(), return_routed_experts=True, routed_experts_start_len=3)
        await client.close()
        return result, str(refused.value)

    result, refused = run(scenario())
    assert result.routed_experts is None and len(result.output_ids) == 2
    assert "HTTP 400" in refused and "higher than the number of input tokens (2)" in refused


def test_abort_by_rid_prefix(engine: tuple[ServerProcess, str]) -> None:
    async def scenario() -> GenerateResult:
        client = engine_client(engine[1])
        task = asyncio.create_task(
            client.generate(PROMPTS[0], SamplingParams(max_new_tokens=1500, ignore_eos=True), rid="traj-7-turn-0")
        )
        await asyncio.sleep(0.5)
        await client.abort_request("traj-7")
        result = (await task)[0]
        await client.close()
        return result

    result = run(scenario())
    assert result.finish_reason.type == "abort"
    assert 0 < len(result.output_ids) < 1500


def test_health_answers_503_while_paused_and_200_after_continue(engine: tuple[ServerProcess, str]) -> None:
    """As SGLang (http_server.py::health_generate waits at the pause gate): a paused engine is not healthy."""

    async def statuses(session: aiohttp.ClientSession) -> list[int]:
        return [(await session.get(engine[1] + path)).status for path in ("/health_generate", "/health")]

    async def scenario() -> tuple[list[int], list[int], bool]:
        client = engine_client(engine[1])
        async with aiohttp.ClientSession() as session:
            await client.pause_generation("in_place")
            try:
                paused, paused_ok = await statuses(session), await client.health(timeout_s=5)
            finally:
                await client.continue_generation()
            resumed = await statuses(session)
        await client.close()
        return paused, resumed, paused_ok

    paused, resumed, paused_ok = run(scenario())
    assert paused == [503, 503] and not paused_ok
    assert resumed == [200, 200]


def test_sleep_frees_memory_and_wake_restores_outputs(engine: tuple[ServerProcess, str]) -> None:
    server, url = engine
    process = psutil.Process(server.pid)
    weight_bytes = 6_000_000 * 4

    async def scenario() -> tuple[list[GenerateResult], list[GenerateResult], int, int, str]:
        client = engine_client(url)
        assert await client.flush_cache()  # sleeping drops the prefix cache: start from none to compare bits
        before = [(await client.generate(p, GREEDY, return_logprob=True))[0] for p in PROMPTS]  # one at a time:
        rss_awake = process.memory_info().rss
        await client.release_memory_occupation()
        rss_asleep = process.memory_info().rss
        with pytest.raises(EngineError) as refused:
            await client.generate(PROMPTS[0], GREEDY)
        await client.resume_memory_occupation()
        after = [(await client.generate(p, GREEDY, return_logprob=True))[0] for p in PROMPTS]  # bit-comparable
        await client.close()
        return before, after, rss_awake, rss_asleep, str(refused.value)

    before, after, rss_awake, rss_asleep, refused = run(scenario())
    assert rss_awake - rss_asleep > 0.8 * weight_bytes, (rss_awake, rss_asleep)
    assert "released" in refused
    assert [r.output_ids for r in after] == [r.output_ids for r in before]
    assert [r.output_logprobs for r in after] == [r.output_logprobs for r in before]


def test_release_walks_only_objects_made_since_start_up(engine: tuple[ServerProcess, str]) -> None:
    """The server froze its start-up objects (torch, transformers, the model), so a release's collection walks
    only the few that serving made since."""

    async def scenario() -> dict[str, int]:
        client = engine_client(url)
        await client.generate(PROMPTS[1], GREEDY)
        await client.release_memory_occupation()
        await client.resume_memory_occupation()
        info = await client.server_info()
        await client.close()
        return dict(info["gc"])

    url = engine[1]
    counts = run(scenario())
    assert counts["frozen"] > 10 * counts["tracked"], counts


def _check_engine_matches(url: str, model: torch.nn.Module) -> None:
    results = run(_generate_all(url, PROMPTS, GREEDY))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)
        expected = hf_logprobs(model, prompt, result.output_ids)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-5, rtol=0)


async def _push_by_handle(url: str, model: torch.nn.Module, version: str, flattened: bool = False) -> str:
    client = engine_client(url)
    named = [(name, t.detach().clone()) for name, t in model.state_dict().items()]
    await client.begin_weight_update()
    if flattened:  # one buffer, each tensor a view of it, as the sync executor packs a bucket
        flat = torch.cat([t.reshape(-1) for _, t in named])
        views, start = [], 0
        for name, t in named:
            views.append((name, flat[start : start + t.numel()].view(t.shape)))
            start += t.numel()
        entry, load_format = serialize_flattened_bucket(flat, views), "flattened_bucket"
    else:
        entry, load_format = serialize_named_tensors(named), None
    await client.update_weights_from_tensor([entry], load_format=load_format, weight_version=version)
    await client.end_weight_update()
    info = await client.model_info()
    await client.close()
    return str(info["weight_version"])


def test_weight_update_by_handle_twice(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    url = engine[1]
    model = load_hf(model_dir)
    for step, (seed, flattened) in enumerate(((11, False), (12, True))):
        randomize(model, seed)
        assert run(_push_by_handle(url, model, f"v{step}", flattened)) == f"v{step}"
        _check_engine_matches(url, model)
    assert run(_push_by_handle(url, load_hf(model_dir), "original")) == "original"


def test_weight_update_needs_a_session(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    async def scenario() -> str:
        client = engine_client(engine[1])
        named = [("lm_head.weight", load_hf(model_dir).lm_head.weight.detach().clone())]
        with pytest.raises(EngineError) as info:
            await client.update_weights_from_tensor([serialize_named_tensors(named)])
        await client.close()
        return str(info.value)

    assert "begin_weight_update" in run(scenario())


async def _push_by_broadcast(url: str, model: torch.nn.Module, group: object, flattened: bool) -> None:
    client = engine_client(url)
    named = [(name, t.detach().clone()) for name, t in model.state_dict().items()]
    names, dtypes = [n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]

    def send() -> None:
        if flattened:
            offsets, total = flat_offsets([t.dtype for _, t in named], shapes)
            buffer = torch.zeros(total, dtype=torch.uint8)
            for (_, t), start in zip(named, offsets, strict=True):
                buffer[start : start + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
            broadcast(group, buffer)
        else:
            for _, t in named:
                broadcast(group, t)

    sender = threading.Thread(target=send)
    await client.begin_weight_update()
    update = asyncio.create_task(
        client.update_weights_from_distributed(
            names, dtypes, shapes, load_format="flattened_bucket" if flattened else None
        )
    )
    sender.start()
    await update
    await asyncio.to_thread(sender.join)
    await client.end_weight_update()
    await client.close()


def test_weight_update_by_gloo_broadcast_twice(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    url = engine[1]

    async def join() -> object:
        client, port = engine_client(url), free_port()
        joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo"))
        group = await asyncio.to_thread(init_weight_group, "127.0.0.1", port, 0, 2, backend="gloo", timeout_s=60)
        await joined
        await client.close()
        return group

    group = run(join())
    model = load_hf(model_dir)
    for seed, flattened in ((21, False), (22, True)):
        randomize(model, seed)
        run(_push_by_broadcast(url, model, group, flattened))
        _check_engine_matches(url, model)

    async def destroy() -> None:
        client = engine_client(url)
        await client.destroy_weights_update_group()
        await client.close()

    run(destroy())  # then rebuild the group (e.g. the trainer restarted) and restore the original weights
    close_weight_group(group)  # frees the group's name in this process, as the trainer's transport does
    group = run(join())
    run(_push_by_broadcast(url, load_hf(model_dir), group, flattened=True))
    _check_engine_matches(url, load_hf(model_dir))
    run(destroy())
    close_weight_group(group)


def test_a_failed_step_aborts_its_requests_and_the_engine_keeps_serving(model_dir: Path) -> None:
    engine = EmbeddedEngine(EngineArgs(model_path=str(model_dir)))
    finished: list[Sequence] = []
    done = threading.Semaphore(0)

    def on_done(seq: Sequence) -> None:
        finished.append(seq)
        done.release()

    def seq(rid: str, prompt: list[int]) -> Sequence:
        sampling = RowSampling(temperature=0.0, top_p=1.0, top_k=-1, generator=None)
        return Sequence(rid=rid, prompt=prompt, sampling=sampling, max_new_tokens=4, stop_ids=frozenset())

    try:
        engine.submit([seq("bad", [engine.vocab_size + 5])], on_done)  # past the request checks: the forward fails
        assert done.acquire(timeout=30)
        engine.submit([seq("good", [1, 2, 3])], on_done)
        assert done.acquire(timeout=30)
    finally:
        engine.shutdown()
    bad, good = finished
    assert bad.finish is not None and bad.finish.type == "abort" and "IndexError" in str(bad.finish.message)
    assert good.finish is not None and good.finish.type == "length" and len(good.output) == 4


def test_prefix_cache_serves_the_next_turn_and_flushes(engine: tuple[ServerProcess, str], model_dir: Path) -> None:
    hf = load_hf(model_dir)
    prompt = PROMPTS[1]

    async def scenario() -> tuple[list[GenerateResult], int]:
        client = engine_client(engine[1])
        assert await client.flush_cache()
        first = (await client.generate(prompt, GREEDY))[0]
        turn2 = prompt + first.output_ids + [30, 31]
        second = (await client.generate(turn2, GREEDY, return_logprob=True))[0]
        partial = (await client.generate([*prompt[:2], 99, 98], GREEDY))[0]
        assert await client.flush_cache()
        again = (await client.generate(turn2, GREEDY, return_logprob=True))[0]
        info = await client.server_info()
        await client.close()
        return [first, second, partial, again], info["embedded_stats"]["cached_tokens"]

    (first, second, partial, again), cached_total = run(scenario())
    turn2 = prompt + first.output_ids + [30, 31]
    assert (first.cached_tokens, second.cached_tokens, partial.cached_tokens, again.cached_tokens) == (
        0,
        len(prompt) + len(first.output_ids) - 1,
        2,
        0,
    )
    assert cached_total >= second.cached_tokens + 2
    assert second.output_ids == again.output_ids == hf_greedy(hf, turn2, GREEDY.max_new_tokens)
    expected = hf_logprobs(hf, turn2, second.output_ids)
    torch.testing.assert_close(torch.tensor(second.output_logprobs), expected, atol=1e-5, rtol=0)
