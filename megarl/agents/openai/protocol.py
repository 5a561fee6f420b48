"""The OpenAI chat-completions wire format the session server speaks: requests in, completions and errors out.

Field names and meanings follow OpenAI's API reference (`POST /v1/chat/completions`), as SGLang's own server reads
them (`srt/entrypoints/openai/protocol.py::ChatCompletionRequest`, `serving_chat.py::_build_chat_response`):
`finish_reason` is `tool_calls` when the reply holds parsed calls, `length` when the token budget cut it, else
`stop`; a tool call's `arguments` is a JSON string. What megarl cannot honour (n > 1, a forced `tool_choice`,
non-text content) is answered HTTP 400 naming the parameter, never silently ignored.
"""

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from megarl.agents.tool_parsers import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request megarl answers with an OpenAI-shaped error: HTTP `status`, the offending `param`, a `code`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(kw_only=True, slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    """The conversation, content flattened to text, tool-call arguments parsed to objects (what templates render)."""
    tools: list[dict[str, Any]] | None = None
    use_tools: bool = True
    """False under tool_choice=none: the reply is not parsed for calls."""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    stream: bool = False
    model: str = ""

    @property
    def offers_tools(self) -> bool:
        """The reply is parsed for calls: tools given and tool_choice not none (SGLang resolves an absent tool_choice
        to `auto` with tools and `none` without: `ChatCompletionRequest`'s validator)."""
        return self.use_tools and bool(self.tools)

    @classmethod
    def parse(cls, body: Any) -> "ChatRequest":
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1: each sample is one trajectory (run the agent n times instead)", "n")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        return cls(
            messages=[_message(m, i) for i, m in enumerate(messages)],
            tools=_tools(body.get("tools")),
            use_tools=_tool_choice(body.get("tool_choice")),
            temperature=_number(body, "temperature"),
            top_p=_number(body, "top_p"),
            max_tokens=_positive(max_tokens, "max_tokens"),
            stop=[body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or None,
            logprobs=bool(body.get("logprobs")),
            stream=bool(body.get("stream")),
            model=str(body.get("model", "")),
        )


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message as the chat template reads it: role, text content, tool calls with object arguments."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{index}] needs a role in {list(ROLES)}", f"messages[{index}].role")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"), index)}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [_call(call, index) for call in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise RequestError(
        f"messages[{index}].content: only text is served (a string or text parts)", f"messages[{index}].content"
    )


def _call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each needs function.name", f"messages[{index}].tool_calls")
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise RequestError(f"messages[{index}].tool_calls: arguments are not JSON ({err.msg})") from err
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        raise RequestError("tools must be a list of {type: function, function: {...}}", "tools")
    return tools or None


def _tool_choice(choice: Any) -> bool:
    if choice in (None, "auto"):
        return True
    if choice == "none":
        return False
    raise RequestError(
        f"tool_choice={choice!r}: megarl does not constrain decoding; use auto or none", "tool_choice", "unsupported"
    )


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is not None and not isinstance(value, int | float):
        raise RequestError(f"{key} must be a number", key)
    return None if value is None else float(value)


def _positive(value: Any, key: str) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise RequestError(f"{key} must be a positive integer", key)
    return value


@dataclass(kw_only=True, slots=True)
class Reply:
    """One model turn as the client sees it."""

    content: str
    calls: list[ToolCall]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    """OpenAI's per-token entries (token, logprob, bytes, top_logprobs) when the request asked for them."""

    def message(self, call_ids: list[str]) -> dict[str, Any]:
        """The assistant message: content (None when only calls), then the calls with JSON-string arguments."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.calls:
            out["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for cid, c in zip(call_ids, self.calls, strict=True)
            ]
        return out


def completion(reply: Reply, model: str) -> dict[str, Any]:
    """The `chat.completion` object of `reply`."""
    ids = call_ids(len(reply.calls))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": reply.message(ids),
                "logprobs": None if reply.logprobs is None else {"content": reply.logprobs},
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
    }


def chunks(reply: Reply, model: str) -> list[dict[str, Any]]:
    """`stream=true`: the whole reply as `chat.completion.chunk` events (the engine answers a turn at once): the role
    and content, each call in one piece, then the finish reason."""
    whole = completion(reply, model)
    choice, head = whole["choices"][0], {k: whole[k] for k in ("id", "created", "model")}
    delta: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if "tool_calls" in choice["message"]:
        delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(choice["message"]["tool_calls"])]
    first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reply.finish_reason}
    return [head | {"object": "chat.completion.chunk", "choices": [c]} for c in (first, last)]


def call_ids(count: int) -> list[str]:
    return [f"call_{uuid.uuid4().hex[:24]}" for _ in range(count)]


def models(name: str) -> dict[str, Any]:
    """`GET /v1/models`."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "megarl"}]}
