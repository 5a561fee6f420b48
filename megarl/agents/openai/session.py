"""One sample's conversation as exact token ids, across every chat completion its agent sends.

A session holds segments. A segment is `prompt ids ‖ response ids`, the response being the model's ids (mask 1,
with their log-probs, weight versions and routings) and the chat template's deltas between them (mask 0):

    request k extends the history (its messages start with the previous request's messages + the reply sent)
        → input = previous ids + delta(new messages)       (ChatTokens.delta: nothing earlier is re-encoded)
    request k rewrites it (an edit, a dropped or summarised turn, other tools)
        → agents.openai.on_history_rewrite: new_segment (a fresh encoding of its messages starts a segment) | fail

The row a session trains is its last segment: earlier segments' model tokens were sampled in contexts the last one
does not hold (they are counted: `openai/segments`, `openai/untrained_model_tokens`). A request that would leave
no room for one model token within data.max_prompt_length / max_response_length is refused (HTTP 400,
`context_length_exceeded`); the tokens kept so far stay the row.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from megarl.agents.base import AgentOutput, RoutedExperts
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.openai.protocol import ChatRequest, RequestError
from megarl.engines.client.sglang_api import GenerateResult


@dataclass(kw_only=True, slots=True)
class Limits:
    prompt_length: int
    response_length: int
    max_turns: int
    on_history_rewrite: str = "new_segment"


@dataclass(kw_only=True)
class Segment:
    prompt_ids: list[int]
    tools_key: str
    """The tool schemas the prompt rendered (another set is a rewrite)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The messages these ids encode: the last request's, then the reply sent."""
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: RoutedExperts = field(default_factory=RoutedExperts)
    ended_with_eos: bool = False

    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(
        self, ids: list[int], mask: int, logprobs: list[float] | None = None, versions: list[int] | None = None
    ) -> None:
        self.response_ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


@dataclass(kw_only=True, slots=True)
class Turn:
    """A request made ready: the ids to send, the delta they end with, the token budget."""

    input_ids: list[int]
    delta: list[int]
    max_new_tokens: int
    segment: Segment


class Session:
    def __init__(self, chat: ChatTokens, limits: Limits) -> None:
        self.chat, self.limits = chat, limits
        self.segments: list[Segment] = []
        self.turns = 0
        self.ended: str | None = None
        """Why the server refused a request of this session (length, max_turns, history_rewrite), if it did."""
        self.last_finish = "stop"
        """The engine's finish reason of the last turn (stop | length | abort)."""
        self.messages: list[dict[str, Any]] = []
        """The last request's messages and its reply, as text (for rollout dumps)."""

    def prepare(self, request: ChatRequest) -> Turn:
        """The ids of `request`'s turn (module docstring), or RequestError."""
        if self.turns >= self.limits.max_turns:
            self._end("max_turns", f"the session's {self.limits.max_turns} turns are used (agents.openai.max_turns)")
        tools_key = json.dumps(request.tools, sort_keys=True)
        last = self.segments[-1] if self.segments else None
        if last is not None and _extends(request.messages, last.history) and tools_key == last.tools_key:
            delta = self.chat.delta(request.messages[len(last.history) :], last.ended_with_eos)
            return self._budget(last, delta, request.max_tokens)
        if last is not None and self.limits.on_history_rewrite == "fail":
            self._end(
                "history_rewrite",
                "the messages do not extend the session's conversation; agents.openai.on_history_rewrite=fail",
                code="history_rewrite",
            )
        prompt = self.chat.encode(request.messages, add_generation_prompt=True, tools=request.tools)
        if len(prompt) > self.limits.prompt_length:
            self._end(
                "length", f"the prompt is {len(prompt)} tokens > data.max_prompt_length", "context_length_exceeded"
            )
        return self._budget(Segment(prompt_ids=prompt, tools_key=tools_key), [], request.max_tokens)

    def _budget(self, segment: Segment, delta: list[int], max_tokens: int | None) -> Turn:
        room = self.limits.response_length - len(segment.response_ids) - len(delta)
        if room < 1:
            self._end(
                "length",
                f"no model token fits in data.max_response_length={self.limits.response_length} after this request",
                "context_length_exceeded",
            )
        budget = room if max_tokens is None else min(room, max_tokens)
        return Turn(input_ids=segment.ids() + delta, delta=delta, max_new_tokens=budget, segment=segment)

    def _end(self, reason: str, message: str, code: str | None = None) -> None:
        self.ended = reason
        raise RequestError(message, code=code or reason)

    def record(self, turn: Turn, request: ChatRequest, result: GenerateResult, reply: dict[str, Any]) -> None:
        """Keep `turn`'s delta (mask 0) and the model's ids (mask 1); `reply` is the assistant message sent."""
        segment = turn.segment
        if not self.segments or segment is not self.segments[-1]:
            self.segments.append(segment)
        segment.append(turn.delta, mask=0)
        ids = list(result.output_ids)
        segment.append(ids, 1, list(result.output_logprobs or [0.0] * len(ids)), result.token_versions())
        segment.routed.add(result, len(turn.input_ids))
        segment.ended_with_eos = bool(ids) and ids[-1] in self.chat.eos_ids
        segment.history = [*request.messages, _comparable(reply)]
        self.messages = segment.history
        self.last_finish = result.finish_reason.type
        self.ended = None  # a refused request the agent got past (e.g. a shorter history) no longer ends the row
        self.turns += 1

    def output(self, prompt_ids: list[int]) -> AgentOutput:
        """The last segment as a row (`prompt_ids`, the sample's own prompt, when no request was answered)."""
        if not self.segments:
            return AgentOutput(prompt_ids=list(prompt_ids), response_ids=[], response_mask=[], response_logprobs=[])
        last = self.segments[-1]
        return AgentOutput(
            prompt_ids=list(last.prompt_ids),
            response_ids=list(last.response_ids),
            response_mask=list(last.mask),
            response_logprobs=list(last.logprobs),
            response_versions=list(last.versions),
            num_turns=_turns(last.mask),
            messages=list(self.messages),
            routed_experts=last.routed.joined(),
            metrics=self.metrics(),
        )

    def metrics(self) -> dict[str, float]:
        untrained = sum(sum(s.mask) for s in self.segments[:-1])
        return {
            "openai/requests": float(self.turns),
            "openai/segments": float(len(self.segments)),
            "openai/untrained_model_tokens": float(untrained),
        }


def _extends(messages: list[dict[str, Any]], history: list[dict[str, Any]]) -> bool:
    return len(messages) >= len(history) and messages[: len(history)] == history


def _comparable(reply: dict[str, Any]) -> dict[str, Any]:
    """The assistant message sent, as `protocol._message` reads it when the client sends it back."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in reply["tool_calls"]
        ]
    return out


def _turns(mask: list[int]) -> int:
    """Model turns and the template deltas between them: the runs of equal mask values."""
    return sum(1 for i, m in enumerate(mask) if i == 0 or m != mask[i - 1])
