"""The session server's chat-completion protocol (`megarl/agents/openai/protocol.py`) against SGLang 0.5.23's own
OpenAI server models (`srt/entrypoints/openai/protocol.py`, tests/cases/sglang_side.py `openai_chat`), on CPU: the
bodies an agent sends resolve to the same limits, stops and tool choice in both, what SGLang refuses megarl refuses,
and megarl's completions and stream chunks are valid SGLang responses."""

from typing import Any

import pytest
from cases.agent_cases import CHECK_SCHEMA
from cases.sglang_env import run_side, sglang_site

from megarl.agents.openai.protocol import ChatRequest, Reply, RequestError, chunks, completion
from megarl.agents.tool_parsers import ToolCall

CALL = {"id": "call_1", "type": "function", "function": {"name": "check_answer", "arguments": '{"answer": "7"}'}}
HISTORY = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "The answer 7 is correct."},
]
ACCEPTED = [
    {"model": "m", "messages": HISTORY[:2], "tools": [CHECK_SCHEMA], "max_tokens": 7, "stop": "###", "logprobs": True},
    {"model": "m", "messages": HISTORY, "tools": [CHECK_SCHEMA], "max_completion_tokens": 9, "tool_choice": "none"},
    {"model": "m", "messages": HISTORY[:2], "temperature": 0.3, "top_p": 0.9, "stream": True, "stop": ["a", "b"]},
]
REFUSED = [
    {"model": "m", "messages": [{"role": "robot", "content": "hi"}]},
    {"model": "m", "messages": HISTORY[:2], "max_tokens": "many"},
]
REPLIES = [
    Reply(
        content="",
        calls=[ToolCall(name="check_answer", arguments={"answer": "7"})],
        finish_reason="tool_calls",
        prompt_tokens=30,
        completion_tokens=12,
        logprobs=[{"token": "<", "logprob": -0.1, "bytes": [60], "top_logprobs": []}],
    ),
    Reply(content="#### 7", calls=[], finish_reason="stop", prompt_tokens=40, completion_tokens=4),
    Reply(content="#### 7 and th", calls=[], finish_reason="length", prompt_tokens=40, completion_tokens=8),
]


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    payload = {
        "requests": ACCEPTED + REFUSED,
        "responses": [completion(reply, "megarl") for reply in REPLIES],
        "chunks": [chunk for reply in REPLIES for chunk in chunks(reply, "megarl")],
    }
    return run_side(sglang_site(), "openai_chat", payload)


def test_accepted_bodies_resolve_as_sglang_resolves_them(sglang: dict[str, Any]) -> None:
    for body, theirs in zip(ACCEPTED, sglang["requests"], strict=False):
        ours = ChatRequest.parse(body)
        assert "error" not in theirs, theirs
        stop = [theirs["stop"]] if isinstance(theirs["stop"], str) else theirs["stop"]
        assert (ours.max_tokens, ours.stop) == (theirs["max_new_tokens"], stop)
        assert ours.offers_tools == (theirs["tool_choice"] != "none")
        assert (ours.logprobs, ours.stream, theirs["n"]) == (bool(theirs["logprobs"]), theirs["stream"], 1)
        for key in ("temperature", "top_p"):
            if key in body:
                assert getattr(ours, key) == theirs[key] == body[key]


def test_what_sglang_refuses_megarl_refuses(sglang: dict[str, Any]) -> None:
    for body, theirs in zip(REFUSED, sglang["requests"][len(ACCEPTED) :], strict=True):
        assert "error" in theirs
        with pytest.raises(RequestError):
            ChatRequest.parse(body)


def test_completions_and_chunks_are_valid_sglang_responses(sglang: dict[str, Any]) -> None:
    assert sglang["responses"] == ["ok"] * len(REPLIES)
    assert sglang["chunks"] == ["ok"] * 2 * len(REPLIES)
