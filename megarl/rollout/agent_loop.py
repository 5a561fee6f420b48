"""Agent loops: what one sample's rollout does, from prompt ids to response ids, mask and log-probs.

An agent worker builds one loop object per loop name with the shared `AgentContext` and calls
`await loop.run(sample, sampling)` once per sample, all samples concurrently. Loops talk to the
engines only through the router, token ids in and token ids out. Names resolve through `AGENT_LOOPS`
(single_turn, tool_agent) or, for a user's loop, a `package.module:Class` path to an `AgentLoop`
subclass.
"""

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from megarl.config.rollout import MultiTurnConfig
from megarl.plugins import import_callable
from megarl.rollout.chat_tokens import ChatTokens
from megarl.rollout.interactions.base import BaseInteraction
from megarl.rollout.protocol import GenerateResult
from megarl.rollout.router import Router
from megarl.rollout.sampling import SamplingParams
from megarl.rollout.tool_parsers import ToolCallParser
from megarl.rollout.tools.base import BaseTool


@dataclass(kw_only=True, slots=True)
class AgentSample:
    sample_id: str
    """Unique per trajectory: the router's sticky key and the prefix of its request ids."""
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    """The prompt's chat messages (what interactions read)."""
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    """Per tool name: {create_kwargs: {...}, execute_kwargs: {...}}."""
    interaction_kwargs: dict[str, Any] | None = None
    """{name: <interaction>, ...kwargs for start_interaction}; None = no interaction."""
    seed: int | None = None
    """Sampling seed of the first request; turn k uses seed + k."""


@dataclass(kw_only=True, slots=True)
class AgentOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 = the model's token, 0 = a tool/user token."""
    response_logprobs: list[float]
    """The engine's log-prob of each model token; 0.0 for tool/user tokens."""
    reward: float | None = None
    """Tool step rewards + tools' calc_reward + interaction turn rewards; None when no tool or interaction ran."""
    num_turns: int = 1
    """Model turns + tool/user turns in the response."""
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The whole conversation as text (for rollout dumps; never re-encoded)."""


@dataclass(kw_only=True, slots=True)
class AgentContext:
    router: Router
    chat: ChatTokens
    response_length: int
    """Response tokens per trajectory, all turns together."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    tools: dict[str, BaseTool] = field(default_factory=dict)
    interactions: dict[str, BaseInteraction] = field(default_factory=dict)
    parser: ToolCallParser | None = None


class AgentLoop:
    """Base of every agent loop; subclasses implement `run`."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        raise NotImplementedError(f"{type(self).__name__} does not implement run()")

    async def generate(
        self, sample: AgentSample, input_ids: list[int], sampling: SamplingParams, max_new_tokens: int, turn: int
    ) -> GenerateResult:
        """One model turn of `sample` (log-probs included), on its sticky replica."""
        seed = None if sample.seed is None else sample.seed + turn
        params = dataclasses.replace(sampling, max_new_tokens=max_new_tokens, n=1, sampling_seed=seed)
        [result] = await self.context.router.generate(
            input_ids, params, return_logprob=True, trajectory_id=sample.sample_id, rid=f"{sample.sample_id}-{turn}"
        )
        return result


class SingleTurnAgentLoop(AgentLoop):
    """One generation of up to the response budget."""

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        started = time.perf_counter()
        result = await self.generate(sample, sample.prompt_ids, sampling, self.context.response_length, turn=0)
        ids = list(result.output_ids)
        text = self.context.chat.decode_reply(ids)
        return AgentOutput(
            prompt_ids=list(sample.prompt_ids),
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=list(result.output_logprobs or [0.0] * len(ids)),
            finish_reason=result.finish_reason.type,
            metrics={"gen_seconds": time.perf_counter() - started},
            messages=[*sample.messages, {"role": "assistant", "content": text}],
        )


def resolve_agent_loop(name: str) -> type[AgentLoop]:
    """The loop class registered as `name`, or a user's `package.module:Class` (an AgentLoop subclass)."""
    from megarl.rollout.tool_agent_loop import ToolAgentLoop

    registry: dict[str, type[AgentLoop]] = {"single_turn": SingleTurnAgentLoop, "tool_agent": ToolAgentLoop}
    if name in registry:
        return registry[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"agent loop {name!r} is unknown; choose {sorted(registry)} or a `package.module:Class` path")
    cls = import_callable(name)
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ValueError(f"agent loop {name!r} is not an AgentLoop subclass (megarl.rollout.agent_loop.AgentLoop)")
    return cls
