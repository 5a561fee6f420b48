"""The client's requests against SGLang 0.5.23's schema, its error handling, and tensor handles."""

import asyncio
import base64
import os
import pickle
from typing import Any

import pytest
import torch
from aiohttp import web
from cases.engine_cases import engine_client, router_of, run

from megarl.engines.client.client import ClientTimeouts, EngineError, EngineUnavailable
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import (
    ABORTED_WAITING,
    REQUEST_FIELDS,
    GenerateResult,
    check_payload,
    version_number,
)
from megarl.engines.weights.tensor_handles import (
    deserialize_named_tensors,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megarl.engines.weights.weight_group import flat_offsets
from megarl.ports import free_port

# A reply of SGLang 0.5.23 with --skip-tokenizer-init and return_logprob (tokenizer_manager._handle_batch_output).
SGLANG_REPLY = {
    "output_ids": [17, 2],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "e2e_latency": 0.1,
        "weight_version": "v3",
        "output_token_logprobs": [[-0.5, 17, None], [None, 2, None]],
    },
}


class Recorder:
    """A stand-in server on loopback that records every request and answers like SGLang."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.delay_s = delay_s

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, body))
        await asyncio.sleep(self.delay_s)
        if request.path == "/generate":
            return web.json_response(SGLANG_REPLY)
        if request.path == "/update_weights_from_tensor" and body["weight_version"] == "refuse":
            return web.json_response({"success": False, "message": "not in a weight update session"}, status=400)
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.")
        return web.json_response({"success": True, "message": ""})

    async def serve(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, f"http://127.0.0.1:{port}"


def test_every_client_request_matches_the_sglang_schema() -> None:
    recorder = Recorder()

    async def scenario() -> list[GenerateResult]:
        runner, url = await recorder.serve()
        client = engine_client(url)
        sampling = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=[2], extra={"min_p": 0.1})
        results = await client.generate([1, 2, 3], sampling, return_logprob=True, rid="traj-1")
        await client.abort_request("traj-1")
        await client.pause_generation("retract")
        await client.continue_generation()
        await client.release_memory_occupation(["kv_cache"])
        await client.resume_memory_occupation()
        await client.begin_weight_update()
        await client.update_weights_from_tensor(["abc="], flush_cache=False, weight_version="v1")
        await client.init_weights_update_group("10.0.0.1", 2900, 1, 3, backend="gloo")
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], load_format="flattened_bucket")
        await client.end_weight_update()
        await client.destroy_weights_update_group()
        await client.update_weight_version("v2")
        assert await client.flush_cache()
        await client.close()
        await runner.cleanup()
        return results

    results = run(scenario())
    assert [path for _, path, _ in recorder.calls] == [
        "/generate",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/flush_cache",
    ]
    for method, path, body in recorder.calls:
        assert method == "POST"
        if path in REQUEST_FIELDS:
            check_payload(path, body)
    bodies = {path: body for _, path, body in recorder.calls}
    assert bodies["/generate"] == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [2],
            "ignore_eos": False,
            "n": 1,
            "min_p": 0.1,
        },
        "return_logprob": True,
        "rid": "traj-1",
    }
    assert bodies["/init_weights_update_group"]["group_name"] == "weight_update_group"
    assert bodies["/update_weights_from_distributed"]["dtypes"] == ["bfloat16"]
    assert bodies["/release_memory_occupation"] == {"tags": ["kv_cache"]}
    assert bodies["/resume_memory_occupation"] == {"tags": None}
    (result,) = results
    assert result.output_ids == [17, 2] and result.weight_version == "v3"
    assert result.output_logprobs == [-0.5, float("-inf")]
    assert result.finish_reason.type == "stop" and result.finish_reason.matched == 2


def _reply(ids: list[int], spans: list[tuple[str, int, int]], finish: dict[str, Any]) -> dict[str, Any]:
    """An SGLang reply without prompt_tokens, as for a request aborted in its waiting queue."""
    meta = {
        "id": "r",
        "finish_reason": finish,
        "weight_version": spans[-1][0],
        "weight_versions": [{"version": v, "start": start, "end": end} for v, start, end in spans],
        "output_token_logprobs": [[-float(t), t, None] for t in ids],
    }
    return {"output_ids": ids, "meta_info": meta}


def test_weight_versions_per_token_and_across_a_resume() -> None:
    assert [version_number(v) for v in ("v12", "v0", "default", None)] == [12, 0, 0, 0]
    for bad in ("12", "v1.5", "step3", "v", "original"):
        with pytest.raises(ValueError, match=repr(bad)):
            version_number(bad)
    assert GenerateResult.from_json(SGLANG_REPLY, 3).token_versions() == [3, 3], "no spans: weight_version's"
    abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    partial = GenerateResult.from_json(_reply([4, 5, 6], [("default", 0, 2), ("v1", 2, 3)], abort), 7)
    assert partial.prompt_tokens == 7 and partial.token_versions() == [0, 0, 1]
    length = {"type": "length", "length": 2}
    joined = partial.extended(GenerateResult.from_json(_reply([8, 9], [("v1", 0, 1), ("v2", 1, 2)], length), 10))
    assert joined.output_ids == [4, 5, 6, 8, 9] and joined.output_logprobs == [-4.0, -5.0, -6.0, -8.0, -9.0]
    spans = [(s.version, s.start, s.end) for s in joined.weight_versions]
    assert spans == [("default", 0, 2), ("v1", 2, 4), ("v2", 4, 5)]
    assert joined.token_versions() == [0, 0, 1, 1, 2] and joined.finish_reason.type == "length"
    assert (joined.prompt_tokens, joined.num_resumes, joined.weight_version) == (7, 1, "v2")


class QueuedAbortServer(Recorder):
    """SGLang's answers to a vision-language request with one image placeholder that the engine expands to 16 image
    tokens: aborted in the waiting queue first (no `prompt_tokens`: tokenizer_manager.py::_handle_abort_req), then
    the continuation, whose `prompt_tokens` counts the expanded prompt."""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((request.method, request.path, body))
        if len(self.calls) == 1:
            return web.json_response(_reply([], [("v1", 0, 0)], {"type": "abort", "message": ABORTED_WAITING}))
        reply = _reply([7, 2], [("v1", 0, 2)], {"type": "stop", "matched": 2})
        reply["meta_info"]["prompt_tokens"] = len(body["input_ids"]) + 15
        return web.json_response(reply)


def test_a_vision_request_aborted_in_the_queue_counts_its_expanded_prompt() -> None:
    """The 3 ids sent hold one placeholder for 16 image tokens: the aborted reply's prompt is 18 tokens, as the
    resumed continuation's SGLang count (18 + 0 output tokens so far) says, or joining the two fails."""
    server = QueuedAbortServer()

    async def scenario() -> list[GenerateResult]:
        runner, url = await server.serve()
        router = router_of([url], resume_aborted=True)
        try:
            sampling = SamplingParams(max_new_tokens=4)
            return await router.generate([1, 9, 3], sampling, rid="r", image_data=["aW1n"], expanded_tokens=15)
        finally:
            await router.close()
            await runner.cleanup()

    (result,) = run(scenario())
    assert (result.prompt_tokens, result.output_ids, result.num_resumes) == (18, [7, 2], 1)
    assert [body["image_data"] for _, _, body in server.calls] == [["aW1n"], ["aW1n"]]


def test_payload_checks_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"unknown fields \['seed'\]"):
        check_payload("/generate", {"input_ids": [1], "seed": 1})
    with pytest.raises(ValueError, match=r"missing required \['world_size'\]"):
        check_payload("/init_weights_update_group", {"master_address": "a", "master_port": 1, "rank_offset": 1})
    with pytest.raises(ValueError, match="'inplace'"):  # refused before anything is sent
        run(engine_client(f"http://127.0.0.1:{free_port()}").pause_generation("inplace"))


def test_errors_are_raised_with_the_engine_message_and_never_hang() -> None:
    async def scenario() -> None:
        recorder = Recorder(delay_s=2.0)
        runner, url = await recorder.serve()
        slow = engine_client(url, timeouts=ClientTimeouts(generate_s=0.3, control_s=5))
        with pytest.raises(EngineUnavailable, match="/generate failed: TimeoutError"):
            await slow.generate([1], SamplingParams())
        with pytest.raises(EngineError, match="not in a weight update session"):
            await slow.update_weights_from_tensor(["x"], weight_version="refuse")
        await slow.close()
        await runner.cleanup()
        dead = engine_client(f"http://127.0.0.1:{free_port()}", timeouts=ClientTimeouts(read_retries=1))
        with pytest.raises(EngineUnavailable, match="model_info failed"):
            await dead.model_info()
        assert not await dead.health(timeout_s=1.0)
        with pytest.raises(EngineUnavailable, match="not healthy after 1 s"):
            await dead.wait_healthy(timeout_s=1.0)
        await dead.close()

    run(scenario())


def test_tensor_handles_round_trip_without_copy_and_refuse_other_pickles() -> None:
    weights = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8).to(torch.bfloat16))]
    received = deserialize_named_tensors(serialize_named_tensors(weights))
    assert [n for n, _ in received] == [n for n, _ in weights]
    for (_, sent), (_, got) in zip(weights, received, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    weights[0][1].add_(1.0)  # shared memory: the receiver sees the sender's later writes
    assert torch.equal(received[0][1], weights[0][1])

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="may not reference"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([("x", Evil())])).decode())


def test_flat_offsets_pack_back_to_back_and_refuse_unaligned_ones() -> None:
    offsets, total = flat_offsets([torch.float32, torch.bfloat16, torch.uint8], [[2], [3], [5]])
    assert offsets == [0, 8, 14] and total == 19
    with pytest.raises(ValueError, match="would start at byte 6, not a multiple of its itemsize 4"):
        flat_offsets([torch.bfloat16, torch.float32], [[3], [1]])


def test_flattened_bucket_round_trips_as_views_of_one_shared_buffer() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    named = [("a", flat[:6].view(2, 3)), ("b", flat[6:])]
    received = deserialize_named_tensors(serialize_flattened_bucket(flat, named), "flattened_bucket")
    assert [(n, t.shape) for n, t in received] == [("a", (2, 3)), ("b", (4,))]
    flat.add_(1.0)  # one shared buffer: the receiver sees the sender's later writes through every view
    assert torch.equal(received[0][1], named[0][1]) and torch.equal(received[1][1], named[1][1])
    with pytest.raises(ValueError, match="not a contiguous view inside the flattened bucket"):
        serialize_flattened_bucket(flat, [("c", torch.zeros(2))])
    with pytest.raises(ValueError, match="must unpickle to"):
        deserialize_named_tensors(serialize_named_tensors(named), "flattened_bucket")
