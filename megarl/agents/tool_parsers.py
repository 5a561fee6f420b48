"""Tool-call parsers: the model's text of one turn → its tool calls and what was malformed.

Registered by name (`rollout.multi_turn.tool_call_parser`); a `package.module:Class` path loads a
user's parser, any class with `parse(text) -> ParsedTurn`.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from megarl.plugins import import_callable


@dataclass(kw_only=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(kw_only=True, slots=True)
class ParsedTurn:
    content: str
    """The text outside tool-call blocks."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, in text order (the model reads them as tool responses)."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5 / Hermes format).
    `arguments` may be an object or a JSON string of one; an unclosed block is malformed."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, outside, end = [], [], [], 0
        for match in self._BLOCK.finditer(text):
            outside.append(text[end : match.start()])
            end = match.end()
            body = match.group(1).strip()
            if not match.group(2):
                errors.append(f"Error: the tool call {_clip(body)!r} has no closing </tool_call> tag.")
                continue
            call = _call_from_json(body)
            if isinstance(call, str):
                errors.append(call)
            else:
                calls.append(call)
        outside.append(text[end:])
        return ParsedTurn(content="".join(outside).strip(), calls=calls, errors=errors)


def _call_from_json(body: str) -> ToolCall | str:
    """The call in one block, or an error message for the model."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return f"Error: the tool call {_clip(body)!r} is not valid JSON ({err.msg} at char {err.pos})."
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f'Error: a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {_clip(body)!r}.'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"Error: the arguments of the call to {obj['name']!r} are not a JSON object."
    if not isinstance(arguments, dict):
        return f"Error: the arguments of the call to {obj['name']!r} must be a JSON object."
    return ToolCall(name=obj["name"], arguments=arguments)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


PARSERS: dict[str, type] = {"hermes": HermesParser}


def make_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`, or a user class given as `package.module:Class`."""
    if name in PARSERS:
        return PARSERS[name]()
    if "." not in name and ":" not in name:
        raise ValueError(
            f"rollout.multi_turn.tool_call_parser={name!r} is unknown; choose {sorted(PARSERS)} or a dotted path"
        )
    parser = import_callable(name)()
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"rollout.multi_turn.tool_call_parser={name!r} has no parse(text) method")
    return parser
