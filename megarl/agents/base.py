"""The agent-loop contract: what one sample's rollout takes and returns, and the base class.

An agent worker builds one loop object per loop name with the shared `AgentContext` and calls
`await loop.run(sample, sampling)` once per sample, all samples concurrently. Loops talk to the
engines only through the router, token ids in and token ids out. `registry.resolve_agent_loop` maps
names to loop classes.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.images import TrajectoryImages
from megarl.agents.interactions.base import BaseInteraction
from megarl.agents.tool_parsers import ToolCallParser
from megarl.agents.tools.base import BaseTool
from megarl.config.agents import OpenAIAgentConfig
from megarl.config.rollout import MultiTurnConfig
from megarl.data.images import ImageProcessor
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult, collapse_image_tokens


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
    info: dict[str, Any] = field(default_factory=dict)
    """The row's `data_source`, `ground_truth` and `extra_info` (what an `openai` agent is handed)."""
    routed_experts: bool = False
    """Ask the engines which experts each token was routed to (training rollouts under R3 routing replay; never
    validation, whose trajectories are not trained on)."""
    images: TrajectoryImages | None = None
    """A vision-language trajectory's images so far (the prompt's, then those tools return); None for text."""


@dataclass(kw_only=True, slots=True)
class AgentOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 = the model's token, 0 = a tool/user token."""
    response_logprobs: list[float]
    """The engine's log-prob of each model token; 0.0 for tool/user tokens."""
    response_versions: list[int] | None = None
    """The weight version number (`sglang_api.version_number`) that sampled each model token, -1 on tool/user
    tokens; None = the loop does not report versions (the batch then holds -1 everywhere)."""
    reward: float | None = None
    """Tool step rewards + tools' calc_reward + interaction turn rewards (an `openai` agent's return); None when no
    tool or interaction ran."""
    reward_extra: dict[str, float] = field(default_factory=dict)
    """Components of `reward` (an `openai` agent's dict return), logged and kept as reward extras."""
    num_turns: int = 1
    """Model turns + tool/user turns in the response."""
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The whole conversation as text (for rollout dumps; never re-encoded)."""
    routed_experts: torch.Tensor | None = None
    """`[n, num_hidden_layers·k]` int, as the engine answers (dense layers 0): the experts each MoE layer sent token t
    of prompt ‖ response to, for t < n (the engine never forwards the last token; layout:
    `GenerateResult.routed_experts`); None unless asked for. `to_batch` keeps the MoE layers' columns."""


@dataclass(slots=True)
class RoutedExperts:
    """One trajectory's routed experts, joined over turns and resubmissions: rows cover positions [0, `rows`) of
    prompt ‖ response. Each request asks for the rows from `rows` on (SGLang's `routed_experts_start_len`), so a
    turn's tokens, and the previous turn's last token that only this turn forwards, are recorded once."""

    parts: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def add(self, result: GenerateResult, input_len: int) -> None:
        if result.routed_experts is None:
            return
        self.parts.append(result.routed_experts)
        self.rows += len(result.routed_experts)
        assert self.rows == input_len + len(result.output_ids) - 1, "routings cover every forwarded token once"

    def joined(self) -> torch.Tensor | None:
        rows = [part for part in self.parts if len(part)]
        return torch.cat(rows) if rows else None


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
    prompt_length: int = 0
    """Prompt tokens a trajectory may start from (data.max_prompt_length; loops that encode their own prompts)."""
    openai: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)
    reward_function: bool = False
    """reward.function is set: it scores every row, whatever a loop reports."""
    images: ImageProcessor | None = None
    """A vision-language model's image processor and image token; None for a text model."""


class AgentLoop:
    """Base of every agent loop; subclasses implement `run`."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        raise NotImplementedError(f"{type(self).__name__} does not implement run()")

    async def close(self) -> None:
        """Release what the loop holds beyond its samples (servers, connection pools); the worker calls it once."""

    async def model_turn(
        self,
        sample: AgentSample,
        input_ids: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        turn: int,
        routed: RoutedExperts | None = None,
    ) -> GenerateResult:
        """One model turn of `sample` (log-probs and per-token versions included), on its sticky replica. With the
        router's `resume_aborted`, a turn cut by a pause in abort mode comes back whole. When the sample asks for
        routed experts, the turn's are added to `routed`."""
        seed = None if sample.seed is None else sample.seed + turn
        params = dataclasses.replace(sampling, max_new_tokens=max_new_tokens, n=1, sampling_seed=seed)
        held = routed.rows if routed is not None else 0
        sent, image_data = input_ids, None
        if sample.images is not None and sample.images.encoded:  # one placeholder per image: the engine expands
            assert self.context.images is not None, "a sample with images needs the model's image codec"
            sent = collapse_image_tokens(input_ids, self.context.images.image_token_id)
            image_data = sample.images.encoded
        [result] = await self.context.router.generate(
            sent,
            params,
            image_data=image_data,
            expanded_tokens=len(input_ids) - len(sent),
            return_logprob=True,
            trajectory_id=sample.sample_id,
            rid=f"{sample.sample_id}-{turn}",
            return_routed_experts=sample.routed_experts,
            routed_experts_start_len=held,
        )
        if routed is not None:
            routed.add(result, len(input_ids))
        return result
