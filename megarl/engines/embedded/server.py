"""The embedded engine's HTTP server: SGLang 0.5.23's endpoints and JSON fields (see engines/client/sglang_api.py)."""

import asyncio
import gc
import logging
import pickle
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.sglang_api import DEFAULT_GROUP_NAME, PAUSE_MODES, REQUEST_FIELDS, check_payload
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.classify import refuse_classify
from megarl.engines.embedded.engine import EmbeddedEngine
from megarl.engines.embedded.lora_server import LoraEndpoints
from megarl.engines.embedded.requests import BadRequest, parse_generate, response
from megarl.engines.embedded.weights import load_named, read_weight
from megarl.engines.weights.tensor_handles import LOAD_FORMATS, deserialize_named_tensors, sharing_pid
from megarl.engines.weights.weight_group import broadcast, close_weight_group, flat_offsets, init_weight_group, nbytes

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
"""Like SGLang: unhealthy if the engine loop does not answer within this."""
NOT_FLUSHED = (
    "weights updated, but the cache was not flushed because requests are still running or queued; "
    "retract or finish them, then call /flush_cache"
)
"""An update's answer when its flush found the engine busy (weight_updater.py::flush_cache_after_weight_update)."""


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


class EngineServer:
    """Routes HTTP requests to the engine thread; control calls run there between decode steps.

    Pausing follows tokenizer_manager.py::pause_generation/continue_generation: a pause closes the `unpaused`
    gate, which every /generate call passes before it reaches the engine, so calls arriving while paused stay
    open and no pause touches them; continue opens it.
    """

    def __init__(self, engine: EmbeddedEngine, keys: EngineKeys | None = None) -> None:
        self.engine = engine
        self.keys = keys or EngineKeys()
        """`--api-key` and `--admin-api-key`, checked per endpoint as SGLang does (`EngineKeys.allows`)."""
        self.in_weight_update = False
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.in_flight_rids: set[str] = set()
        """Rids of the open /generate calls, waiting at the gate or running."""
        self.num_running_calls = 0
        """Open /generate calls past the gate (SGLang's model_update_lock readers)."""
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.lora = LoraEndpoints(engine, self._on_engine)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        routes = [
            ("*", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/ready", self.ready),
            ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.model_info),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info),
            ("*", "/flush_cache", self.flush_cache),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("*", "/release_memory_occupation", self.release_memory),
            ("*", "/resume_memory_occupation", self.resume_memory),
            ("POST", "/begin_weight_update", self.begin_weight_update),
            ("POST", "/end_weight_update", self.end_weight_update),
            ("POST", "/update_weights_from_tensor", self.update_from_tensor),
            ("POST", "/init_weights_update_group", self.init_group),
            ("POST", "/destroy_weights_update_group", self.destroy_group),
            ("POST", "/update_weights_from_distributed", self.update_from_distributed),
            ("POST", "/update_weight_version", self.update_weight_version),
            ("*", "/get_weights_by_name", self.get_weights_by_name),
            *self.lora.routes(),
            ("*", "/classify", refuse_classify),  # served with --is-embedding (classify.py)
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self.keys.allows(request.path, request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)  # srt/utils/auth.py::add_api_key_middleware
        try:
            return await handler(request)
        except ValueError as e:  # bad field values, like SGLang's ValueError → 400
            return _error(str(e))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON body, checked against the endpoint's fields (SGLang answers unknown fields with 400)."""
        body = await request.json() if request.can_read_body else {}
        if request.path in REQUEST_FIELDS and request.path != "/generate":
            check_payload(request.path, body)
        return dict(body)

    async def _on_engine(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    async def generate(self, request: web.Request) -> web.Response:
        """Parse, wait while paused (tokenizer_manager.py::generate_request waits on is_pause_cond before the
        request reaches the scheduler), then run on the engine."""
        started = time.monotonic()
        try:
            seqs, as_list, return_logprob = parse_generate(await request.json(), self.engine)
        except BadRequest as e:
            return _error(str(e))
        rids = {s.rid for s in seqs}
        if clash := sorted(rids & self.in_flight_rids):
            return _error(f"rid {clash[0]} is already in flight")
        self.in_flight_rids |= rids
        try:
            await self.unpaused.wait()
            if released := sorted(self.engine.released & {"weights", "kv_cache"}):
                return _error(f"engine memory {released} is released; call /resume_memory_occupation first")
            async with self.lora.using(seqs):  # adapters resolved past the gate, as SGLang does
                finished = await self._run(seqs)
        except BadRequest as e:
            return _error(str(e))
        finally:
            self.in_flight_rids -= rids
        out = [response(s, return_logprob, started) for s in finished]
        return web.json_response(out if as_list else out[0])

    async def _run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Submit `seqs` and wait until each has finished; a client that hangs up aborts them."""
        loop = asyncio.get_running_loop()
        futures = {id(s): loop.create_future() for s in seqs}

        def done(seq: Sequence) -> None:
            loop.call_soon_threadsafe(futures[id(seq)].set_result, seq)

        self.num_running_calls += 1
        self.engine.submit(seqs, done)
        try:
            return list(await asyncio.gather(*futures.values()))
        except asyncio.CancelledError:
            for s in seqs:
                self.engine.abort(s.rid, message="client disconnected")
            raise
        finally:
            self.num_running_calls -= 1

    async def health(self, request: web.Request) -> web.Response:
        """503 while paused (at once; http_server.py::health_generate's one-token probe waits at the pause gate, so
        SGLang answers 503 after HEALTH_CHECK_TIMEOUT), else 200 once the engine loop answers."""
        if not self.unpaused.is_set():
            return web.Response(status=503, text="generation is paused; call /continue_generation")
        try:
            await asyncio.wait_for(self._on_engine(lambda: None), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503, text="engine loop did not answer")
        return web.Response(text="")

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.unpaused.is_set() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        args = self.engine.args
        return web.json_response(
            {
                "model_path": args.model_path,
                "tokenizer_path": None,
                "served_model_name": args.model_path,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
                "load_format": args.load_format,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        paused, adapters = not self.unpaused.is_set(), sorted(self.lora.loaded)

        def snapshot() -> dict[str, Any]:
            stats = asdict(self.engine.stats)
            stats["batch_size_histogram"] = {str(k): v for k, v in stats["batch_size_histogram"].items()}
            return {
                "args": asdict(self.engine.args),
                "max_req_input_len": self.engine.context_length - 1,
                "embedded_stats": stats,
                "in_flight": self.engine.num_in_flight,
                "paused": paused,
                "released": sorted(self.engine.released),
                "lora_adapters": adapters,
                "gc": {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())},
            }

        return web.json_response(await self._on_engine(snapshot))

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self._on_engine(self.engine.flush_if_idle):
            return web.Response(text="Cache flushed.")
        return web.Response(status=400, text="Cache not flushed: requests are running or queued.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.engine.abort(body.get("rid", ""), abort_all=bool(body.get("abort_all", False)))
        return web.Response(text="")

    async def pause_generation(self, request: web.Request) -> web.Response:
        """Close the gate, then (tokenizer_manager.py and scheduler.py::pause_generation): abort ends the running
        requests and answers once their calls have; retract pauses the engine after moving its running rows
        back to the queue without their KV; in_place pauses it as it is."""
        mode = (await self._body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(f"pause_generation mode={mode!r}: use one of {PAUSE_MODES}")
        self.unpaused.clear()
        if mode == "abort":
            await self._drain()
        elif mode == "retract":
            await self._on_engine(self.engine.retract_all)
        else:
            await self._on_engine(lambda: self.engine.set_paused(True))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _drain(self) -> None:
        """Abort everything until no /generate call is past the gate. Consumes nothing; waits (polling every
        50 ms) for the aborted calls to answer, which ends it; SGLang re-sends abort_all the same way while
        its model_update_lock has readers. The closed gate keeps new calls out, so it always ends."""
        while self.num_running_calls:
            self.engine.abort(abort_all=True)
            await asyncio.sleep(0.05)

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request)
        await self._on_engine(lambda: self.engine.set_paused(False))
        self.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await self._body(request)).get("tags")
        await self._on_engine(lambda: self.engine.release(tags))  # a ValueError becomes a 400 (middleware)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await self._body(request)).get("tags")
        await self._on_engine(lambda: self.engine.resume(tags))  # a ValueError becomes a 400 (middleware)
        return web.json_response(None)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.in_weight_update = True
        return _result(True, "weight update session started")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.in_weight_update = False
        return _result(True, "weight update session ended")

    async def _load(self, body: dict[str, Any], named: list[tuple[str, torch.Tensor]]) -> web.Response:
        """In one engine call between steps: copy `named` into the model, switch to the body's weight_version and
        flush the prefix cache if asked and idle (weight_updater.py::update_weights_from_tensor: load, then
        record_weight_version_after_update, then flush_cache_after_weight_update, whose refusal fails the call
        although the weights changed)."""
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        version = body.get("weight_version")

        def load() -> bool:
            load_named(self.engine.model, named)
            self.engine.set_weight_version(None if version is None else str(version))
            return not body.get("flush_cache", True) or self.engine.flush_if_idle()

        try:
            flushed = await self._on_engine(load)
        except ValueError as e:
            return _result(False, str(e))
        return _result(True, "weights updated") if flushed else _result(False, NOT_FLUSHED)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not self.in_weight_update:
            return _result(False, "call /begin_weight_update before updating weights")
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:
            return _result(False, f"load_format={load_format!r}: the embedded engine takes {LOAD_FORMATS}")
        entries = body["serialized_named_tensors"]
        if len(entries) != 1:
            return _result(False, f"{len(entries)} serialized_named_tensors entries; this engine has 1 TP rank")
        try:
            named = deserialize_named_tensors(entries[0], load_format)
        except (ValueError, pickle.UnpicklingError) as e:
            return _result(False, f"serialized_named_tensors[0]: {e}")
        by_storage = {tensor.untyped_storage().data_ptr(): tensor for _, tensor in named}  # a bucket's views share one
        pids = sorted({pid for tensor in by_storage.values() if (pid := sharing_pid(tensor)) is not None})
        if pids:  # whose memory this engine mapped: a handle from another node would name a pid there
            logger.info("weights: %d tensor(s) mapped from shared memory of pid %s", len(named), pids)
        return await self._load(body, named)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("backend", "nccl") == "nccl" and self.engine.device.type != "cuda":
            return _result(False, "backend=nccl needs a CUDA engine; use backend=gloo")
        group_name = body.get("group_name", DEFAULT_GROUP_NAME)
        if group_name in self.groups:
            return _result(False, f"weight update group {group_name!r} exists; destroy it first")
        group = await asyncio.to_thread(
            init_weight_group,
            body["master_address"],
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            group_name,
            body.get("backend", "nccl"),
        )
        self.groups[group_name] = group
        return _result(True, f"joined {group_name} as rank {body['rank_offset']}")

    async def destroy_group(self, request: web.Request) -> web.Response:
        group_name = (await self._body(request)).get("group_name", DEFAULT_GROUP_NAME)
        group = self.groups.pop(group_name, None)
        if group is None:
            return _result(False, f"no weight update group {group_name!r}")
        close_weight_group(group)
        return _result(True, f"left {group_name}")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not self.in_weight_update:
            return _result(False, "call /begin_weight_update before updating weights")
        group = self.groups.get(body.get("group_name", DEFAULT_GROUP_NAME))
        if group is None:
            return _result(False, f"no weight update group {body.get('group_name')!r}; call /init_weights_update_group")
        if body.get("load_format") not in (None, "flattened_bucket"):
            return _result(False, f"load_format={body['load_format']!r}: use null or flattened_bucket")
        names, shapes = list(body["names"]), [list(s) for s in body["shapes"]]
        try:
            dtypes = [_dtype(d) for d in body["dtypes"]]
            # refuses what SGLang's FlattenedTensorBucket.empty refuses, before the broadcast starts
            layout = flat_offsets(dtypes, shapes) if body.get("load_format") == "flattened_bucket" else None
        except ValueError as e:
            return _result(False, str(e))
        named = await asyncio.to_thread(_receive, group, names, dtypes, shapes, layout, self.engine.device)
        return await self._load(body, named)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("abort_all_requests", True):
            self.engine.abort(abort_all=True)
        version = str(body["new_version"])
        await self._on_engine(lambda: self.engine.set_weight_version(version))
        return web.json_response({"success": True, "message": "ok", "new_version": version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The weight's first `truncate_size` rows as fp32 numbers (srt/models/llama.py::get_weights_by_name)."""
        body = await self._body(request)
        name, rows = body["name"], int(body.get("truncate_size", 100))
        return web.json_response(await self._on_engine(lambda: read_weight(self.engine.model, name, rows)))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; send names like 'bfloat16'")
    return dtype


def _receive(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    layout: tuple[list[int], int] | None,
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """Receive the broadcast tensors in `names` order, or, given the flattened `layout` (byte offsets,
    total), one uint8 bucket of them back to back (as weight_updater.py::receive_weights_from_distributed)."""
    if layout is not None:
        offsets, total = layout
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        broadcast(group, buffer)
        return [
            (name, buffer[start : start + nbytes(dtype, shape)].view(dtype).view(shape))
            for name, dtype, shape, start in zip(names, dtypes, shapes, offsets, strict=True)
        ]
    named = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        broadcast(group, tensor)
        named.append((name, tensor))
    return named
