"""Async client of one engine's HTTP server (SGLang or the embedded engine): connection-pooled, never hangs.

Every request has a timeout. Connection failures raise `EngineUnavailable` (the router retries the
request on another replica); HTTP errors and `success: false` replies raise `EngineError` with the
engine's own message. Only idempotent reads are retried here.
"""

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.classify_api import classify_scores
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import (
    DEFAULT_GROUP_NAME,
    HEALTH_PATH,
    PAUSE_MODES,
    GenerateResult,
    check_payload,
    image_data_field,
)

logger = logging.getLogger(__name__)


_UNAVAILABLE = (502, 503, 504)
"""Statuses of an engine (or its proxy) that is down or overloaded, not of a bad request."""


class EngineError(RuntimeError):
    """The engine answered with an error (or `success: false`)."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, dropped the connection or did not answer in time."""


@dataclass(kw_only=True, slots=True)
class ClientTimeouts:
    connect_s: float = 10.0
    """Opening a connection."""
    generate_s: float = 1800.0
    """One /generate call (a long multi-sample request on a busy engine)."""
    control_s: float = 600.0
    """Weight updates, memory release/resume, pause and other control calls."""
    read_retries: int = 2
    """Extra attempts for idempotent reads (health, info) after a connection failure."""
    retry_backoff_s: float = 0.5
    """Wait before the first retry; doubles each time."""


class EngineClient:
    """One engine replica's API at `url` (e.g. http://10.0.0.3:30000); each request carries the key of `keys` its
    endpoint takes (`EngineKeys.for_path`)."""

    def __init__(self, url: str, keys: EngineKeys | None = None, timeouts: ClientTimeouts | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeouts = timeouts or ClientTimeouts()
        self._keys = keys or EngineKeys()
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.url})"

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector)
            self._loop = loop
        return self._session

    def _auth_headers(self, path: str) -> dict[str, str]:
        key = self._keys.for_path(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        if payload is not None:
            check_payload(path, payload)
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.timeouts.connect_s)
        session, headers = self._get_session(), self._auth_headers(path)
        try:
            async with session.request(method, self.url + path, json=payload, headers=headers, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status in _UNAVAILABLE:
                    raise EngineUnavailable(f"{method} {self.url}{path} returned HTTP {resp.status}: {text[:500]}")
                if resp.status != 200:
                    raise EngineError(f"{method} {self.url}{path} returned HTTP {resp.status}: {text[:500]}")
                if resp.content_type == "application/json":
                    return await resp.json()
                return text
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            raise EngineUnavailable(f"{method} {self.url}{path} failed: {type(e).__name__}: {e}") from e

    async def _read(self, path: str) -> Any:
        delay = self.timeouts.retry_backoff_s
        for _ in range(self.timeouts.read_retries):
            try:
                return await self._call("GET", path, None, self.timeouts.control_s)
            except EngineUnavailable:
                await asyncio.sleep(delay)
                delay *= 2
        return await self._call("GET", path, None, self.timeouts.control_s)

    async def _control(self, path: str, payload: dict[str, Any]) -> Any:
        reply = await self._call("POST", path, payload, self.timeouts.control_s)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"POST {self.url}{path} failed: {reply.get('message')}")
        return reply

    async def health(self, timeout_s: float = 30.0) -> bool:
        """True if the engine answers `/health_generate` with 200 within `timeout_s`."""
        try:
            await self._call("GET", HEALTH_PATH, None, timeout_s)
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll health until it answers; raise EngineUnavailable after `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.health(timeout_s=min(30.0, timeout_s)):
            if asyncio.get_running_loop().time() > deadline:
                raise EngineUnavailable(f"{self.url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    async def model_info(self) -> dict[str, Any]:
        return dict(await self._read("/model_info"))

    async def server_info(self) -> dict[str, Any]:
        return dict(await self._read("/server_info"))

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool = False,
        rid: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        lora_path: str | None = None,
        token_ids_logprob: list[int] | None = None,
        image_data: list[str] | None = None,
        expanded_tokens: int = 0,
    ) -> list[GenerateResult]:
        """Generate `sampling.n` samples continuing `input_ids`; with `return_routed_experts`, each with the experts
        its tokens from prompt position `routed_experts_start_len` on were routed to (`GenerateResult.routed_experts`;
        SGLang answers 400 unless 0 <= routed_experts_start_len <= len(input_ids)). `lora_path` names a loaded LoRA
        adapter to sample with (None = the base model); one that is not loaded is answered with 400. With
        `return_logprob`, `token_ids_logprob` names ids whose log-probs each output position reports
        (`GenerateResult.output_token_ids_logprobs`; an id outside the vocabulary is answered with 400). `image_data`
        gives a vision-language prompt's images in order (base64, or anything SGLang's `load_image` reads); then
        `input_ids` hold one image placeholder per image, which the engine expands (`sglang_api.collapse_image_tokens`
        turns expanded ids into that form; `prompt_tokens` and log-prob positions count the expanded prompt, which is
        `expanded_tokens` longer: a reply without `prompt_tokens` counts `len(input_ids) + expanded_tokens`)."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_json(),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            payload["rid"] = rid
        if return_routed_experts:
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = routed_experts_start_len
        if lora_path is not None:
            payload["lora_path"] = lora_path
        if token_ids_logprob is not None:
            payload["token_ids_logprob"] = list(token_ids_logprob)
        if image_data:
            payload["image_data"] = image_data_field(image_data, sampling.n)
        reply = await self._call("POST", "/generate", payload, self.timeouts.generate_s)
        replies = reply if isinstance(reply, list) else [reply]
        prompt_tokens = len(input_ids) + expanded_tokens
        return [GenerateResult.from_json(obj, prompt_tokens, routed_experts_start_len) for obj in replies]

    async def classify(self, input_ids: list[list[int]]) -> list[float]:
        """The score (logit 0 at the last token) of each prompt, from an engine serving a reward model with
        `--is-embedding` (SGLang's `/classify`; an engine serving a causal LM answers 400). One batch request: SGLang
        answers a list of `{embedding, meta_info}` in prompt order (`classify_api.classify_reply`)."""
        payload = {"input_ids": [list(ids) for ids in input_ids]}
        return classify_scores(await self._call("POST", "/classify", payload, self.timeouts.generate_s))

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort every in-flight request whose rid starts with `rid` (or all)."""
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, self.timeouts.control_s)

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False if the engine was busy (it flushes only when idle)."""
        try:
            await self._call("POST", "/flush_cache", None, self.timeouts.control_s)
        except EngineUnavailable:
            raise
        except EngineError:
            return False
        return True

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating until `continue_generation`; new /generate calls wait meanwhile. `mode`:
        abort: running requests end now with their partial output (finish_reason abort; this returns once all have
        answered); retract: they go back to the queue, their KV freed, and are prefilled again (prompt + output so
        far) after continue, under the weights of that time; in_place: they keep their KV and resume after continue
        (a cache flush then fails while they run). Weight updates are allowed while paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode={mode!r}; SGLang 0.5.23 takes one of {PAUSE_MODES}")
        await self._control("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Undo `pause_generation`: retracted and paused requests resume, waiting /generate calls go in."""
        await self._control("/continue_generation", {"torch_empty_cache": True})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Sleep: free `tags` (weights, kv_cache, cuda_graph; None = all). The engine must be idle."""
        await self._control("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Wake: re-allocate `tags` released before (None = all)."""
        await self._control("/resume_memory_occupation", {"tags": tags})

    async def begin_weight_update(self) -> None:
        """Open the session that tensor and distributed weight updates must run in."""
        await self._control("/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self) -> None:
        await self._control("/end_weight_update", {})

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """Load tensors shared by handle (one serialized entry per engine TP rank; see tensor_handles)."""
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        await self._control("/update_weights_from_tensor", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """Join the broadcast group the trainer (rank 0) created; blocks until every rank joined."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._control("/init_weights_update_group", payload)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave and free the broadcast group (to rebuild it, e.g. after the trainer's ranks changed)."""
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None:
        """Receive tensors broadcast by rank 0 of `group_name`, in `names` order (dtypes like "bfloat16")."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        await self._control("/update_weights_from_distributed", payload)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The engine's weight `name` (an HF name), its first `truncate_size` rows as fp32 numbers. SGLang answers
        only for some models (`get_weights_by_name` in srt/models/, e.g. llama.py); the embedded engine for all."""
        return list(await self._control("/get_weights_by_name", {"name": name, "truncate_size": truncate_size}))

    async def update_weight_version(self, new_version: str) -> None:
        await self._control("/update_weight_version", {"new_version": new_version, "abort_all_requests": False})

    async def load_lora_adapter_from_tensors(
        self, lora_name: str, config_dict: dict[str, Any], serialized_named_tensors: list[str]
    ) -> None:
        """Load LoRA adapter `lora_name` for `/generate` calls to name in `lora_path` (the engine must run with
        `--enable-lora`, a `--max-lora-rank` >= its rank and its projections among `--lora-target-modules`).
        `config_dict` is PEFT's adapter_config.json (JSON-able); `serialized_named_tensors` holds one entry per engine
        TP rank of its tensors by handle (`megarl.engines.weights.adapters`: `adapter_entries`, or `load_adapter`
        for a whole fleet)."""
        payload = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_named_tensors": serialized_named_tensors,
        }
        await self._control("/load_lora_adapter_from_tensors", payload)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload LoRA adapter `lora_name`: new requests naming it fail; answers once the running ones have ended."""
        await self._control("/unload_lora_adapter", {"lora_name": lora_name})
