"""The session server: OpenAI-compatible chat completions, one base URL per trajectory (`…/sessions/<id>/v1`).

Runs on the agent worker's event loop (aiohttp, already the engine client's HTTP stack; an ASGI stack would add a
second server framework and a thread for nothing). Routes:

    POST /sessions/{id}/v1/chat/completions   a model turn of sample `id` (protocol.ChatRequest), JSON or SSE
    GET  /sessions/{id}/v1/models             the served model name
    GET  /health                              200

Consumes: requests of the sessions `open` registered (an unknown id is 404). Each request waits for its session's
lock (one turn at a time per trajectory, so turns extend each other), then for its model turn through the
router (`AgentLoop.model_turn`: sticky replica, partial-rollout resume, routings recorded). Shutdown: `close()`
stops the site; sessions end with their samples (`release`).
"""

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megarl.agents.base import AgentContext, AgentSample
from megarl.agents.openai.protocol import ChatRequest, Reply, RequestError, chunks, completion, models
from megarl.agents.openai.session import Limits, Session, Turn
from megarl.config.agents import OpenAIAgentConfig
from megarl.engines.client.client import EngineError
from megarl.engines.client.router import NoReplicaAvailable
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult

Generate = Callable[["Live", Turn, SamplingParams], Awaitable[GenerateResult]]
"""One model turn of a session: (the session, its prepared turn, the sampling) → the engine's result."""


@dataclass(kw_only=True)
class Live:
    """A registered session: its tokens, its sampling, its lock, what its requests cost."""

    sample: AgentSample
    session: Session
    sampling: SamplingParams
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    seconds: dict[str, float] = field(default_factory=lambda: {"handler": 0.0, "engine": 0.0})
    parse_errors: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, payload: dict[str, Any], status: int = 200) -> "Answer":
        return cls(status, "application/json", json.dumps(payload).encode())

    @classmethod
    def events(cls, events: list[dict[str, Any]]) -> "Answer":
        """`stream=true`: server-sent events as OpenAI streams them, `data: {chunk}` lines then `data: [DONE]`, in one
        body (the engine answers a turn at once)."""
        lines = [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]
        return cls(200, "text/event-stream", "".join(lines).encode())


class SessionServer:
    def __init__(self, context: AgentContext, config: OpenAIAgentConfig, generate: Generate) -> None:
        self.context, self.config, self.generate = context, config, generate
        self.sessions: dict[str, Live] = {}
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> str:
        """Listen on `agents.openai.host` at a free port (once); the root URL."""
        async with self._starting:
            if self._runner is None:
                app = web.Application(client_max_size=64 << 20)
                app.router.add_route("*", "/sessions/{sid}/v1/{route:.*}", self._http)
                app.router.add_get("/health", _health)
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                listener = socket.create_server((self.config.host, 0))
                await web.SockSite(runner, listener).start()
                self.base_url = f"http://{_advertised(self.config.host)}:{listener.getsockname()[1]}"
                self._runner = runner
        return self.base_url

    def open(self, sample: AgentSample, sampling: SamplingParams) -> Live:
        limits = Limits(
            prompt_length=self.context.prompt_length,
            response_length=self.context.response_length,
            max_turns=self.config.max_turns,
            on_history_rewrite=self.config.on_history_rewrite,
        )
        live = Live(sample=sample, session=Session(self.context.chat, limits), sampling=sampling)
        self.sessions[sample.sample_id] = live
        return live

    def release(self, sample_id: str) -> None:
        self.sessions.pop(sample_id, None)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def handle(self, method: str, path: str, body: bytes) -> Answer:
        """One request, from the socket or from an in-process client (`transport.py`)."""
        started = time.perf_counter()
        live: Live | None = None
        try:
            sid, route = _route(method, path)
            live = self.sessions.get(sid)
            if live is None:
                raise RequestError(f"no session {sid!r} is open on this server", code="session_not_found", status=404)
            if route == "models":
                return Answer.json(models(self.config.model_name))
            chat = ChatRequest.parse(_json(body))
            async with live.lock:
                reply = await self._turn(live, chat)
        except RequestError as err:
            return Answer.json(err.body(), err.status)
        finally:
            if live is not None:
                live.seconds["handler"] += time.perf_counter() - started
        if chat.stream:
            return Answer.events(chunks(reply, self.config.model_name))
        return Answer.json(completion(reply, self.config.model_name))

    async def _http(self, request: web.Request) -> web.Response:
        answer = await self.handle(request.method, request.path, await request.read())
        return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)

    async def _turn(self, live: Live, chat: ChatRequest) -> Reply:
        """Prepare the turn's ids, generate, record the tokens, and the reply the client gets."""
        turn = live.session.prepare(chat)
        engine_started = time.perf_counter()
        try:
            result = await self.generate(live, turn, self._sampling(live, chat, turn))
        except (EngineError, NoReplicaAvailable) as err:
            raise RequestError(f"the engines failed this turn: {err}", code="engine_error", status=503) from err
        finally:
            live.seconds["engine"] += time.perf_counter() - engine_started
        reply = self._reply(live, chat, turn, result)
        live.session.record(turn, chat, result, reply.message([f"call_{i}" for i in range(len(reply.calls))]))
        if result.finish_reason.type == "abort":
            live.session.ended = "abort"
            raise RequestError("the engine aborted this turn", code="aborted", status=503)
        return reply

    def _sampling(self, live: Live, chat: ChatRequest, turn: Turn) -> SamplingParams:
        params = dataclasses.replace(live.sampling, max_new_tokens=turn.max_new_tokens)
        if self.config.request_sampling:
            params.temperature = params.temperature if chat.temperature is None else chat.temperature
            params.top_p = params.top_p if chat.top_p is None else chat.top_p
        if chat.stop:
            params.extra = params.extra | {"stop": chat.stop}
        return params

    def _reply(self, live: Live, chat: ChatRequest, turn: Turn, result: GenerateResult) -> Reply:
        ids = list(result.output_ids)
        text = self.context.chat.decode_reply(ids)
        parser = self.context.parser if chat.offers_tools else None
        parsed = parser.parse(text) if parser is not None else None
        calls = parsed.calls if parsed is not None else []
        live.parse_errors += len(parsed.errors) if parsed is not None else 0
        reason = "length" if result.finish_reason.type == "length" else ("tool_calls" if calls else "stop")
        return Reply(
            content=parsed.content if parsed is not None and calls else text,
            calls=calls,
            finish_reason=reason,
            prompt_tokens=len(turn.input_ids),
            completion_tokens=len(ids),
            logprobs=self._logprobs(ids, result.output_logprobs) if chat.logprobs else None,
        )

    def _logprobs(self, ids: list[int], logprobs: list[float] | None) -> list[dict[str, Any]]:
        tokenizer = self.context.chat.tokenizer
        values = logprobs or [0.0] * len(ids)
        texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(texts, values, strict=True)
        ]


ROUTES = {("POST", "chat/completions"): "chat", ("GET", "models"): "models"}


def _route(method: str, path: str) -> tuple[str, str]:
    """(session id, route) of `/sessions/<id>/v1/<route>`, or RequestError 404."""
    parts = path.strip("/").split("/", 3)
    route = ROUTES.get((method, parts[3])) if len(parts) == 4 and parts[0] == "sessions" and parts[2] == "v1" else None
    if route is None:
        raise RequestError(f"{method} {path} is not served; POST …/v1/chat/completions or GET …/v1/models", status=404)
    return parts[1], route


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise RequestError(f"the body is not JSON ({err.msg})") from err


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


def _advertised(host: str) -> str:
    """The host agents on this machine reach the server at (a wildcard bind: this node's address)."""
    if host not in ("0.0.0.0", "::"):
        return host
    return socket.gethostbyname(socket.gethostname())
