"""`Fleet`: every replica of a run, one `EngineClient` each (built once, reused), and the calls that go to all of
them at once: memory release/resume by tags, pause/continue, health, the weight-update session, the version, LoRA
adapters' unloading (loading one passes tensors: `megarl.engines.weights.adapters.load_adapter`).

    fleet = Fleet.connect(urls, keys, ClientTimeouts(control_s=600))
    await fleet.release(["kv_cache", "weights"])   # on the caller's event loop, every replica concurrently
    fleet.wait(fleet.pause("abort"))               # from synchronous code: on the fleet's own loop thread
    fleet.wait(load_adapter(fleet, "megarl-lora-v3", config_dict, named))  # megarl.engines.weights.adapters

A client keeps one HTTP session per event loop, so each process drives its fleet from one loop: the sync
executor from its own (`LoopThread`), the driver through `wait`.
"""

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import ClientTimeouts, EngineClient
from megarl.engines.client.loop_thread import LoopThread

T = TypeVar("T")


class Fleet:
    def __init__(self, clients: list[EngineClient]) -> None:
        self.clients = clients
        """Replica i's client; the only clients of these engines in this process (`connect`)."""
        self._loop: LoopThread | None = None

    @classmethod
    def connect(
        cls, urls: Sequence[str], keys: EngineKeys | None = None, timeouts: ClientTimeouts | None = None
    ) -> "Fleet":
        """Replica i's API at `urls[i]`; every request carries the key of `keys` its endpoint takes and each
        control call has `timeouts.control_s`."""
        return cls([EngineClient(url, keys, timeouts) for url in urls])

    @property
    def urls(self) -> list[str]:
        return [client.url for client in self.clients]

    def only(self, indices: Sequence[int]) -> "Fleet":
        """The replicas at `indices`, sharing this fleet's clients: run its calls with this fleet's `wait`."""
        return Fleet([self.clients[i] for i in indices])

    async def each(self, call: Callable[[EngineClient], Awaitable[T]]) -> list[T]:
        """`call(client)` on every replica concurrently; their answers in replica order."""
        return list(await asyncio.gather(*(call(client) for client in self.clients)))

    async def release(self, tags: list[str] | None = None) -> None:
        """Sleep: every replica frees `tags` (weights, kv_cache, cuda_graph; None = all). The engines must be idle."""
        await self.each(lambda c: c.release_memory_occupation(tags))

    async def resume(self, tags: list[str] | None = None) -> None:
        """Wake: every replica re-allocates `tags` it released (None = all)."""
        await self.each(lambda c: c.resume_memory_occupation(tags))

    async def pause(self, mode: str) -> None:
        """Pause generation on every replica (SGLang's /pause_generation: abort | retract | in_place)."""
        await self.each(lambda c: c.pause_generation(mode))

    async def unpause(self) -> None:
        """Continue generation on every replica after `pause`."""
        await self.each(lambda c: c.continue_generation())

    async def health(self, timeout_s: float) -> list[bool]:
        """Whether each replica answers /health_generate within `timeout_s` (an open path: no key)."""
        return await self.each(lambda c: c.health(timeout_s=timeout_s))

    async def begin_update(self) -> None:
        """Open the weight-update session on every replica."""
        await self.each(lambda c: c.begin_weight_update())

    async def end_update(self) -> None:
        await self.each(lambda c: c.end_weight_update())

    async def finish_update(self, weight_version: str | None) -> None:
        """Close the session, drop the prefixes cached under the old weights and set the version (if given)."""

        async def finish(client: EngineClient) -> None:
            await client.end_weight_update()
            await client.flush_cache()
            if weight_version is not None:
                await client.update_weight_version(weight_version)

        await self.each(finish)

    async def set_version(self, weight_version: str) -> None:
        await self.each(lambda c: c.update_weight_version(weight_version))

    async def unload_adapter(self, lora_name: str) -> None:
        """Every replica unloads `lora_name` once its requests naming it have ended."""
        await self.each(lambda c: c.unload_lora_adapter(lora_name))

    async def close(self) -> None:
        """Close every client's HTTP session (a later call opens a new one)."""
        await self.each(lambda c: c.close())

    def wait(self, call: Coroutine[Any, Any, T]) -> T:
        """Run `call` (one of this fleet's) on the fleet's own loop thread, started on first use; its result."""
        if self._loop is None:
            self._loop = LoopThread("megarl-fleet")
        return self._loop.run(call)

    def shutdown(self) -> None:
        """Close the clients and stop the loop thread `wait` started."""
        if self._loop is not None:
            self._loop.run(self.close())
            self._loop.stop()
            self._loop = None
