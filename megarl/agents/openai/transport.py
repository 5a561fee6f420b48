"""The HTTP client an in-process agent's `openai.AsyncOpenAI` gets: requests go straight to the session server's
`handle`, without a socket.

`agents.openai.in_process=true` (the default): the agent coroutine runs on the agent worker's event loop beside the
server, so a TCP round trip, httpx's connection pool and aiohttp's request parsing would only add CPU to a loop
every session shares (`bench/openai_server.py` measures both). The client is an ordinary httpx `AsyncClient` of the
flavour this `openai` is built on (openai 2.x: `httpx`, 3.x: `httpx2`, same API) with a custom transport; the
openai client builds, sends and parses requests exactly as over a socket. An agent that runs its own process
uses `sample["base_url"]`, the real server.
"""

import importlib
from typing import Any

from megarl.agents.openai.server import SessionServer


def in_process_client(openai: Any, server: SessionServer, timeout_s: float) -> Any:
    """An httpx AsyncClient whose every request is answered by `server.handle`."""
    http = _httpx_of(openai)

    class ToServer(http.AsyncBaseTransport):  # type: ignore[name-defined]  # httpx or httpx2, found at run time
        async def handle_async_request(self, request: Any) -> Any:
            answer = await server.handle(request.method, request.url.path, await request.aread())
            return http.Response(answer.status, headers={"content-type": answer.content_type}, content=answer.body)

    return openai.DefaultAsyncHttpxClient(transport=ToServer(), timeout=openai.Timeout(timeout_s))


def _httpx_of(openai: Any) -> Any:
    """The httpx module `openai`'s default client subclasses."""
    for cls in openai.DefaultAsyncHttpxClient.__mro__:
        if cls.__name__ == "AsyncClient":
            return importlib.import_module(cls.__module__.partition(".")[0])
    raise RuntimeError("openai.DefaultAsyncHttpxClient is not an httpx AsyncClient; set agents.openai.in_process=false")
