"""The session server's request parsing and the `agents.openai.*` checks, without an engine."""

import json
from typing import Any

import pytest
from conftest import REPO

from megarl.agents.openai.protocol import ChatRequest, Reply, RequestError, chunks, completion
from megarl.agents.tool_parsers import ToolCall
from megarl.config.agents import OpenAIAgentConfig, openai_agent_problems

USER = {"role": "user", "content": "hi"}


def _refused(body: Any) -> RequestError:
    with pytest.raises(RequestError) as caught:
        ChatRequest.parse(body)
    return caught.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [USER], "n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [USER], "tools": [{"name": "f"}]}, "tools"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"messages": [USER], "temperature": "hot"}, "temperature"),
    ],
)
def test_what_megarl_cannot_honour_is_refused_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    error = _refused(body)
    assert error.param == param and error.status == 400
    assert error.body()["error"]["param"] == param and error.body()["error"]["type"] == "invalid_request_error"


def test_messages_are_read_as_the_chat_template_renders_them() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "audio": None},
            {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        ],
        "max_completion_tokens": 7,
        "stop": "###",
        "tool_choice": "none",
    }
    request = ChatRequest.parse(body)
    assert request.messages == [
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    ]
    assert (request.max_tokens, request.stop, request.use_tools) == (7, ["###"], False)


def test_a_reply_with_calls_is_a_tool_calls_completion_and_streams_in_two_chunks() -> None:
    reply = Reply(
        content="",
        calls=[ToolCall(name="f", arguments={"x": 1})],
        finish_reason="tool_calls",
        prompt_tokens=5,
        completion_tokens=3,
    )
    body = completion(reply, "megarl")
    message = body["choices"][0]["message"]
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    first, last = chunks(reply, "megarl")
    assert (
        first["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
        and last["choices"][0]["finish_reason"] == "tool_calls"
    )


@pytest.fixture
def examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`examples/` imports from the repository root, which `pytest` (unlike `python -m pytest`) does not put on
    sys.path; users run from the root with `PYTHONPATH=.`."""
    monkeypatch.syspath_prepend(str(REPO))


@pytest.mark.usefixtures("examples_importable")
def test_agent_settings_are_checked_before_any_worker() -> None:
    assert openai_agent_problems(OpenAIAgentConfig(agent="examples.openai_agent.agent:run"), "openai") == []
    problems = openai_agent_problems(
        OpenAIAgentConfig(agent="examples.openai_agent.agent:calculate", on_history_rewrite="merge", max_turns=0), "x"
    )
    assert len(problems) == 3 and "on_history_rewrite='merge'" in problems[0] and "max_turns=0" in problems[1]
    assert "not an `async def run(client, sample)`" in problems[2]
    [missing] = openai_agent_problems(OpenAIAgentConfig(), "openai")
    assert "agents.openai.agent=package.module:function" in missing
    [unknown] = openai_agent_problems(OpenAIAgentConfig(agent="nowhere.at_all:run"), "openai")
    assert "cannot import 'nowhere.at_all:run'" in unknown


@pytest.mark.usefixtures("examples_importable")
def test_the_example_calculator_evaluates_arithmetic_only() -> None:
    from examples.openai_agent.agent import calculate, last_number

    assert calculate('{"expression": "(48 / 2) * 3"}') == "72" and calculate('{"expression": "7 / 2"}') == "3.5"
    assert calculate('{"expression": "__import__(\'os\')"}').startswith("Error: ValueError: only numbers")
    assert calculate('{"expression": "2 ** 1000"}') == "Error: ValueError: exponent too large"
    assert calculate('{"expr": "1"}').startswith("Error: KeyError") and calculate("1/0").startswith("Error")
    assert (last_number("so 1,200.0 in all"), last_number("#### -3"), last_number("none")) == ("1200", "-3", "")
