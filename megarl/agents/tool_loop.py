"""`ToolAgentLoop`: multi-turn rollout with tool calls and interactions, as an explicit state machine.

    PENDING ─► GENERATING ─► PROCESSING_TOOLS ─► GENERATING ...
                   │    └──► INTERACTING ──────► GENERATING ...
                   └───────────────────────────► TERMINATED

GENERATING appends the model's ids (mask 1, with their log-probs and weight versions) and parses its text for
tool calls.
PROCESSING_TOOLS runs up to `max_parallel_calls` calls concurrently, each bounded by `tool_timeout_s`;
malformed calls, unknown tools and failing tools become error messages. INTERACTING asks the
sample's interaction for the next user message. Tool and user messages are tokenized as the chat
template's delta (`ChatTokens.delta`) and appended with mask 0, log-prob 0 and version -1. A pause of the
engines mid-turn changes nothing here: the turn's request just takes longer (retract, in_place), or the
router resumes it (abort), and its tokens carry the versions that sampled them.

A turn cut by `max_new_tokens_per_turn` is closed like any other (the template's EOS and tail are
appended with mask 0) and parsed as usual.

Stops: the model's turn ends without a tool call (and no interaction follows); `max_assistant_turns`
or `max_user_turns` reached; the engine stopped on the response budget or an abort; the interaction
says done or fails; an error with `continue_on_tool_error=false`; a vision-language model sampling its image
token (`sampled_image_token`: in the next request it would be one image placeholder more than the images, which
the engine reads as an image or refuses); or the response budget: a tool/user
turn is appended only when at least one model token still fits after it, so a trajectory never ends
on a tool/user turn. A failing tool calc_reward/release or interaction is logged, never raised.
"""

import asyncio
import enum
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.agents.base import AgentLoop, AgentOutput, AgentSample, RoutedExperts
from megarl.agents.images import TrajectoryImages
from megarl.agents.tool_parsers import ParsedTurn, ToolCall
from megarl.agents.tools.base import ToolResult
from megarl.engines.client.sampling import SamplingParams

logger = logging.getLogger(__name__)


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass(kw_only=True)
class _Trajectory:
    """The mutable state of one sample's run."""

    sample: AgentSample
    sampling: SamplingParams
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: RoutedExperts = field(default_factory=RoutedExperts)
    messages: list[dict[str, Any]] = field(default_factory=list)
    num_assistant_turns: int = 0
    num_user_turns: int = 0
    ended_with_eos: bool = False
    parsed: ParsedTurn | None = None
    finish_reason: str = "stop"
    rewards: list[float] = field(default_factory=list)
    tool_instances: dict[str, str] = field(default_factory=dict)
    """Tool name → instance id, for the tools this trajectory created."""
    interaction: str | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add_metric(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append(value)


class ToolAgentLoop(AgentLoop):
    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        traj = _Trajectory(sample=sample, sampling=sampling, messages=list(sample.messages))
        handlers = {
            State.PENDING: self._start,
            State.GENERATING: self._generate_turn,
            State.PROCESSING_TOOLS: self._process_tools,
            State.INTERACTING: self._interact,
        }
        state = State.PENDING
        try:
            while state is not State.TERMINATED:
                state = await handlers[state](traj)
        finally:
            await self._finish(traj)
        return self._output(traj)

    async def _start(self, traj: _Trajectory) -> State:
        kwargs = traj.sample.interaction_kwargs
        if kwargs:
            name = kwargs.get("name")
            if name not in self.context.interactions:
                raise ValueError(
                    f"sample {traj.sample.sample_id} asks for interaction {name!r}; the interaction config has "
                    f"{sorted(self.context.interactions)} (rollout.multi_turn.interaction_config_path)"
                )
            start_kwargs = {k: v for k, v in kwargs.items() if k != "name"}
            await self.context.interactions[name].start_interaction(traj.sample.sample_id, **start_kwargs)
            traj.interaction = name
        return State.GENERATING

    async def _generate_turn(self, traj: _Trajectory) -> State:
        remaining = self.context.response_length - len(traj.response_ids)
        per_turn = self.context.multi_turn.max_new_tokens_per_turn
        budget = remaining if per_turn is None else min(remaining, per_turn)
        started = time.perf_counter()
        input_ids = traj.sample.prompt_ids + traj.response_ids
        result = await self.model_turn(
            traj.sample, input_ids, traj.sampling, budget, traj.num_assistant_turns, routed=traj.routed
        )
        traj.add_metric("gen_seconds", time.perf_counter() - started)
        ids = list(result.output_ids)
        traj.response_ids += ids
        traj.response_mask += [1] * len(ids)
        traj.logprobs += list(result.output_logprobs or [0.0] * len(ids))
        traj.versions += result.token_versions()
        traj.add_metric("num_resubmits", result.num_resumes)
        traj.num_assistant_turns += 1
        traj.ended_with_eos = bool(ids) and ids[-1] in self.context.chat.eos_ids
        text = self.context.chat.decode_reply(ids)
        traj.messages.append({"role": "assistant", "content": text})
        cut_by_turn_cap = result.finish_reason.type == "length" and len(ids) == budget < remaining
        if result.finish_reason.type != "stop" and not cut_by_turn_cap:
            traj.finish_reason = result.finish_reason.type
            return State.TERMINATED
        mt = self.context.multi_turn
        traj.parsed = self.context.parser.parse(text) if self.context.parser and self._tools_for(traj) else None
        wants_tools = traj.parsed is not None and bool(traj.parsed.calls or traj.parsed.errors)
        if not wants_tools and traj.interaction is None:
            return State.TERMINATED
        if mt.max_assistant_turns is not None and traj.num_assistant_turns >= mt.max_assistant_turns:
            traj.finish_reason = "max_assistant_turns"
            return State.TERMINATED
        if mt.max_user_turns is not None and traj.num_user_turns >= mt.max_user_turns:
            traj.finish_reason = "max_user_turns"
            return State.TERMINATED
        if self.context.images is not None and self.context.images.image_token_id in ids:
            traj.finish_reason = "sampled_image_token"  # the next request would hold a placeholder without an image
            return State.TERMINATED
        return State.PROCESSING_TOOLS if wants_tools else State.INTERACTING

    async def _process_tools(self, traj: _Trajectory) -> State:
        assert traj.parsed is not None
        mt = self.context.multi_turn
        calls = traj.parsed.calls[: mt.max_parallel_calls]
        traj.add_metric("num_tool_calls", len(calls))
        traj.add_metric("num_parse_errors", len(traj.parsed.errors))
        outcomes = await asyncio.gather(*(self._call(traj, call) for call in calls))
        failed = sum(not ok for _, ok in outcomes) + len(traj.parsed.errors)
        traj.add_metric("num_tool_errors", failed)
        if failed and not mt.continue_on_tool_error:
            traj.finish_reason = "tool_error"
            return State.TERMINATED
        side, limit = mt.tool_response_truncate_side, mt.max_tool_response_length
        results = [result for result, _ in outcomes] + [ToolResult(text=error) for error in traj.parsed.errors]
        messages = [_tool_message(_truncate_text(r.text, limit, side), len(r.images)) for r in results]
        images = [image for result in results for image in result.images]
        if images and self.context.images is None:
            traj.finish_reason = "tool_error"  # a text-only model cannot read them
            return State.TERMINATED
        return self._append_user_turn(traj, messages, images)

    async def _call(self, traj: _Trajectory, call: ToolCall) -> tuple[ToolResult, bool]:
        """The tool's result (its message and images), or one whose message is the error; whether it succeeded.
        Never raises."""
        result = await self._try_call(traj, call)
        return (result, True) if isinstance(result, ToolResult) else (ToolResult(text=result), False)

    async def _try_call(self, traj: _Trajectory, call: ToolCall) -> ToolResult | str:
        """The tool's result, or the error message the model reads instead."""
        tools = self._tools_for(traj)
        if call.name not in tools:
            return f"Error: there is no tool named {call.name!r}; the tools are {sorted(tools)}."
        tool = tools[call.name]
        kwargs = traj.sample.tools_kwargs.get(call.name) or {}
        timeout_s = self.context.multi_turn.tool_timeout_s
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                if call.name not in traj.tool_instances:
                    instance = f"{traj.sample.sample_id}/{call.name}"
                    traj.tool_instances[call.name] = await tool.create(instance, **kwargs.get("create_kwargs", {}))
                instance = traj.tool_instances[call.name]
                result = await tool.execute(instance, call.arguments, **kwargs.get("execute_kwargs", {}))
        except TimeoutError:
            return f"Error: the tool {call.name!r} did not answer within {timeout_s} s."
        except Exception as err:  # a tool may fail in any way; the model reads the error and the rollout goes on
            logger.info("tool %r failed on sample %s: %r", call.name, traj.sample.sample_id, err)
            return f"Error: the tool {call.name!r} failed: {type(err).__name__}: {err}"
        finally:
            traj.add_metric("tool_seconds", time.perf_counter() - started)
        traj.rewards.append(result.reward)
        for key, value in result.metrics.items():
            traj.add_metric(f"tool/{call.name}/{key}", float(value))
        return result

    async def _interact(self, traj: _Trajectory) -> State:
        assert traj.interaction is not None
        interaction = self.context.interactions[traj.interaction]
        try:
            reply = await interaction.generate_response(traj.sample.sample_id, traj.messages)
        except Exception as err:  # user code: end this trajectory, keep the others running
            logger.warning("interaction %r failed on sample %s: %r", traj.interaction, traj.sample.sample_id, err)
            traj.finish_reason = "interaction_error"
            return State.TERMINATED
        traj.rewards.append(reply.reward)
        for key, value in reply.metrics.items():
            traj.add_metric(f"interaction/{key}", float(value))
        if reply.done:
            traj.finish_reason = "interaction_done"
            return State.TERMINATED
        return self._append_user_turn(traj, [{"role": "user", "content": reply.text}])

    def _append_user_turn(self, traj: _Trajectory, messages: list[dict[str, Any]], images: Sequence[Any] = ()) -> State:
        """Append tool/user messages (holding one image part per image of `images`) when a model token still fits
        after them; else end the trajectory."""
        ids = self.context.chat.delta(messages, traj.ended_with_eos)
        new = None
        if images:
            assert self.context.images is not None, "images reach a turn only with the model's image codec"
            new = self.context.images.inputs(list(images))
            ids = self.context.images.expand(ids, new)
        if len(traj.response_ids) + len(ids) >= self.context.response_length:
            traj.finish_reason = "length"
            return State.TERMINATED
        if new is not None:
            traj.sample.images = traj.sample.images or TrajectoryImages(encoded=[], inputs=None)
            traj.sample.images.add(new, list(images))
        traj.response_ids += ids
        traj.response_mask += [0] * len(ids)
        traj.logprobs += [0.0] * len(ids)
        traj.versions += [-1] * len(ids)
        traj.messages += messages
        traj.num_user_turns += 1
        return State.GENERATING

    def _tools_for(self, traj: _Trajectory) -> dict[str, Any]:
        """The tools offered to this sample: those its tools_kwargs name, or every tool when it names none."""
        named = traj.sample.tools_kwargs
        return {k: v for k, v in self.context.tools.items() if k in named} if named else self.context.tools

    async def _finish(self, traj: _Trajectory) -> None:
        """Collect the tools' trajectory rewards and release tools and interaction, whatever happened.
        A failing calc_reward counts 0 and, like a failing release, is logged, not raised."""
        for name, instance in traj.tool_instances.items():
            tool = self.context.tools[name]
            try:
                traj.rewards.append(await tool.calc_reward(instance))
            except Exception as err:  # user code; one bad tool must not lose the batch
                _tool_failed(traj, name, "calc_reward", err)
            try:
                await tool.release(instance)
            except Exception as err:  # as above
                _tool_failed(traj, name, "release", err)
        if traj.interaction is not None:
            await self.context.interactions[traj.interaction].finalize_interaction(traj.sample.sample_id)

    def _output(self, traj: _Trajectory) -> AgentOutput:
        ran = bool(traj.tool_instances) or traj.interaction is not None
        averaged = ("tool/", "interaction/")
        metrics = {k: float(sum(v)) for k, v in traj.metrics.items() if not k.startswith(averaged)}
        metrics |= {k: statistics.fmean(v) for k, v in traj.metrics.items() if k.startswith(averaged)}
        return AgentOutput(
            prompt_ids=list(traj.sample.prompt_ids),
            response_ids=traj.response_ids,
            response_mask=traj.response_mask,
            response_logprobs=traj.logprobs,
            response_versions=traj.versions,
            reward=sum(traj.rewards) if ran else None,
            num_turns=traj.num_assistant_turns + traj.num_user_turns,
            finish_reason=traj.finish_reason,
            metrics=metrics,
            messages=traj.messages,
            routed_experts=traj.routed.joined(),
        )


def _tool_message(text: str, num_images: int) -> dict[str, Any]:
    """A tool message: its text, after one image part per image it returned."""
    if not num_images:
        return {"role": "tool", "content": text}
    return {"role": "tool", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}


def _tool_failed(traj: _Trajectory, name: str, step: str, err: Exception) -> None:
    logger.warning("tool %r %s failed on sample %s: %r", name, step, traj.sample.sample_id, err)
    traj.add_metric("num_tool_errors", 1)


def _truncate_text(text: str, max_chars: int, side: str) -> str:
    """Cut a tool response to `max_chars` characters: left keeps the end, right the start, middle both ends."""
    if len(text) <= max_chars:
        return text
    marker = "...(truncated)..."
    keep = max(max_chars - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]
