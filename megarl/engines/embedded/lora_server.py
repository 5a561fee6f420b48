"""The embedded server's LoRA endpoints, and which adapters a /generate call may name (SGLang 0.5.23's).

`/load_lora_adapter_from_tensors` and `/unload_lora_adapter` answer SGLang's `LoRAUpdateOutput` (`success`,
`error_message`, `loaded_adapters` {name: "__tensor__"}), HTTP 400 on failure (http_server.py). Like SGLang's
tokenizer-side registry (lora/lora_registry.py::LoRARegistry), `using` counts the /generate calls running with
each adapter, and an unload first stops new calls from naming it, then waits until the calls using it have
answered, then removes it (tokenizer_control_mixin.py::_unload_lora_adapter_locked: `unregister`,
`wait_for_unload`, then the backend). A /generate call resolves its adapters once past the pause gate, as
tokenizer_manager.py::generate_request does, so a call held there by a pause fails if its adapter goes meanwhile.
"""

import asyncio
import collections
import contextlib
import hashlib
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from aiohttp import web

from megarl.engines.client.sglang_api import check_payload
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine
from megarl.engines.embedded.requests import BadRequest
from megarl.engines.weights.tensor_handles import LOAD_FORMATS, deserialize_tensor_dict

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer to a load or unload without --enable-lora (tokenizer_control_mixin.py)."""
TENSOR_PATH = "__tensor__"
"""The path SGLang lists for an adapter loaded from tensors (LoadLoRAAdapterFromTensorsReqInput.to_ref)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class LoraEndpoints:
    """`engine`'s adapters over HTTP; `on_engine(fn)` runs `fn` on the engine thread."""

    def __init__(self, engine: EmbeddedEngine, on_engine: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.engine = engine
        self._on_engine = on_engine
        self.loaded: set[str] = set()
        """The adapters /generate calls may name: loaded, and not being unloaded."""
        self._uses: collections.Counter[str] = collections.Counter()
        """Sequences of open /generate calls per adapter."""
        self._released = asyncio.Condition()

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [("POST", "/load_lora_adapter_from_tensors", self.load), ("POST", "/unload_lora_adapter", self.unload)]

    @contextlib.asynccontextmanager
    async def using(self, seqs: list[Sequence]) -> AsyncIterator[None]:
        """Count `seqs` as running with their adapters within the block; BadRequest (in SGLang's words) if one
        names an adapter that is not loaded, or LoRA is off (tokenizer_manager.py::_validate_and_resolve_lora)."""
        names = [s.lora_name for s in seqs if s.lora_name is not None]
        if names and self.engine.adapters is None:
            raise BadRequest(
                f"LoRA adapter '{names[0]}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        if unknown := sorted(set(names) - self.loaded):
            raise BadRequest(
                f"The following requested LoRA adapters are not loaded: {unknown[0]}\n"
                f"Loaded adapters: {sorted(self.loaded)}."
            )
        self._uses.update(names)
        try:
            yield
        finally:
            self._uses.subtract(names)
            async with self._released:
                self._released.notify_all()

    async def load(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name, adapters = body["lora_name"], self.engine.adapters
        if adapters is None:
            return self._reply(False, NOT_ENABLED)
        try:
            tensors = _tensors(body)
            await self._on_engine(lambda: adapters.load(name, dict(body["config_dict"]), tensors))
        except (ValueError, pickle.UnpicklingError) as e:
            return self._reply(False, str(e))
        self.loaded.add(name)
        return self._reply(True)

    async def unload(self, request: web.Request) -> web.Response:
        """Refuse new calls naming the adapter, wait for those running with it, then remove it."""
        name = (await _body(request))["lora_name"]
        if self.engine.adapters is None:
            return self._reply(False, NOT_ENABLED)
        if name not in self.loaded:  # lora_registry.py::LoRARegistry.unregister's words
            return self._reply(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.loaded)}")
        self.loaded.discard(name)
        async with self._released:
            await self._released.wait_for(lambda: not self._uses[name])
        del self._uses[name]
        await self._on_engine(lambda: self.engine.unload_adapter(name))
        return self._reply(True)

    def _reply(self, success: bool, error_message: str = "") -> web.Response:
        """SGLang's LoRAUpdateOutput (lora_manager.py::create_lora_update_result)."""
        loaded = {name: TENSOR_PATH for name in sorted(self.loaded)}
        body = {"success": success, "error_message": error_message, "loaded_adapters": loaded}
        return web.json_response(body, status=200 if success else 400)


async def _body(request: web.Request) -> dict[str, Any]:
    body = dict(await request.json())
    check_payload(request.path, body)  # a ValueError: the server's middleware answers 400
    return body


def _tensors(body: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This engine's (its one TP rank's) adapter tensors, checked against `expected_checksums` if given."""
    entries, load_format = body["serialized_named_tensors"], body.get("load_format")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: the embedded engine takes {LOAD_FORMATS}")
    if len(entries) != 1:
        raise ValueError(f"{len(entries)} serialized_named_tensors entries; this engine has 1 TP rank")
    try:
        tensors = deserialize_tensor_dict(entries[0], load_format)
    except (ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"serialized_named_tensors[0]: {e}") from e
    if body.get("expected_checksums") is not None:
        _check_checksums(tensors, body["expected_checksums"])
    return tensors


def _check_checksums(tensors: dict[str, torch.Tensor], expected: dict[str, str]) -> None:
    """ValueError unless `tensors` are exactly those of `expected`, each with that SHA-256 of its bytes (as SGLang's
    tp_worker.py::load_lora_adapter_from_tensors checks `expected_checksums`)."""
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    differ = sorted(n for n in set(expected) & set(tensors) if _sha256(tensors[n]) != expected[n])
    if missing or extra or differ:
        raise ValueError(
            f"adapter tensors do not match expected_checksums: differ {differ[:5]}, missing {missing[:5]}, "
            f"extra {extra[:5]}"
        )


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
