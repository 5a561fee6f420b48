"""`agent_loop=openai` against a real embedded engine serving the scripted model (tests/cases/agent_cases.py): agents
written only against the official `openai` client (tests/cases/openai_agents.py) drive the session server; the
recorded trajectory must be the engine's own ids plus the chat template's deltas, token for token."""

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from cases import openai_agents
from cases.agent_cases import CHECK_SCHEMA, RecordingRouter, Script, make_scripts, scripted_model
from cases.engine_cases import run, start_engine
from transformers import AutoTokenizer

from megarl.agents.base import AgentContext, AgentLoop, AgentOutput, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.openai.loop import OpenAIAgentLoop
from megarl.agents.postprocess import to_batch
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.agents.tool_parsers import HermesParser
from megarl.agents.tools.gsm8k import CheckAnswerTool
from megarl.assets import asset_path
from megarl.config.agents import OpenAIAgentConfig
from megarl.config.rollout import MultiTurnConfig
from megarl.engines.client.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT, RESPONSE = 320, 200


@dataclasses.dataclass
class Served:
    url: str
    chat: ChatTokens
    script: Script


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    server, url = start_engine(scripted_model(tmp_path_factory, chat), tmp_path_factory.mktemp("openai_engine"))
    try:
        yield Served(url, chat, make_scripts()["two_calls"])
    finally:
        server.stop()


def _sample(served: Served) -> AgentSample:
    return AgentSample(
        sample_id=uuid.uuid4().hex,
        prompt_ids=served.script.prompt_ids(served.chat),
        messages=served.script.prompt,
        tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "7"}}},
        info={"ground_truth": "7", "data_source": "test", "extra_info": {}},
    )


def _context(served: Served, router: RecordingRouter, **openai_config: Any) -> AgentContext:
    return AgentContext(
        router=router,
        chat=served.chat,
        response_length=RESPONSE,
        prompt_length=PROMPT,
        multi_turn=MultiTurnConfig(),
        tools={"check_answer": CheckAnswerTool({}, CHECK_SCHEMA)},
        parser=HermesParser(),
        openai=OpenAIAgentConfig(**openai_config),
    )


def roll(served: Served, loop: str, **openai_config: Any) -> tuple[AgentOutput, RecordingRouter, str]:
    """One sample of the two_calls prompt through `loop` (tool_agent, or an `openai_agents` agent's name)."""

    async def go() -> tuple[AgentOutput, RecordingRouter, str]:
        router = RecordingRouter(served.url)
        agent = f"{openai_agents.__name__}:{loop}"
        context = _context(served, router, agent=agent, **openai_config)
        runner: AgentLoop = ToolAgentLoop(context) if loop == "tool_agent" else OpenAIAgentLoop(context)
        sample = _sample(served)
        try:
            return await runner.run(sample, GREEDY), router, sample.sample_id
        finally:
            await runner.close()
            await router.close()

    return run(go())


def test_three_tool_turns_through_the_openai_client_record_the_engines_ids_and_the_deltas(served: Served) -> None:
    """Over HTTP (as an agent in another process talks to `sample["base_url"]`); the other tests go in process."""
    out, router, sid = roll(served, "check_answer", in_process=False)
    responses = openai_agents.RECORDED[sid]
    assert [r.choices[0].finish_reason for r in responses] == ["tool_calls", "tool_calls", "stop"]
    first_call = responses[0].choices[0].message.tool_calls[0]
    assert (first_call.function.name, first_call.function.arguments) == ("check_answer", '{"answer": "6"}')
    assert responses[2].choices[0].message.content == "#### 7" and not responses[2].choices[0].message.tool_calls
    assert len(router.requests) == 3
    ids, mask = list(served.script.prompt_ids(served.chat)), []
    for k, (request, generated) in enumerate(router.requests):
        assert request == ids, f"request {k} is not the previous ids + the model's ids + the template's delta"
        ids += generated
        mask += [1] * len(generated)
        if k < 2:
            delta = served.chat.delta(served.script.turns[2 * k + 1], model_ended_with_eos=True)  # type: ignore[arg-type]
            ids, mask = ids + delta, mask + [0] * len(delta)
    assert out.prompt_ids + out.response_ids == ids and out.response_mask == mask
    assert responses[-1].usage.prompt_tokens == len(router.requests[-1][0])
    assert (out.reward, out.finish_reason, out.num_turns) == (1.0, "stop", 5)
    assert out.metrics["openai/requests"] == 3 and out.metrics["openai/segments"] == 1


def test_the_server_and_tool_agent_loop_give_the_same_rows(served: Served) -> None:
    theirs, _, _ = roll(served, "tool_agent")
    ours, _, _ = roll(served, "check_answer")
    rows = [to_batch([out], PROMPT, RESPONSE, pad_token_id=0) for out in (theirs, ours)]
    for key in (
        "prompts",
        "responses",
        "response_mask",
        "attention_mask",
        "rollout_log_probs",
        "rm_scores",
        "num_turns",
    ):
        assert torch.equal(rows[0][key], rows[1][key]), key
    assert rows[0]["response_mask"].sum() > 0 and rows[0]["rm_scores"].sum() == 1.0


def test_a_history_rewrite_starts_a_new_segment(served: Served) -> None:
    out, router, sid = roll(served, "rewrite")
    edited = [*served.script.prompt[:-1], {"role": "user", "content": "What is 3 + 4? Answer at once."}]
    fresh = served.chat.encode(edited, add_generation_prompt=True)
    [(first_ids, first_out), (second_ids, second_out)] = router.requests
    assert second_ids == fresh, "the rewritten history is encoded afresh, not spliced onto the old ids"
    assert out.prompt_ids == fresh and out.response_ids == second_out and out.response_mask == [1] * len(second_out)
    assert out.metrics["openai/segments"] == 2 and out.metrics["openai/untrained_model_tokens"] == len(first_out)
    assert (out.reward, out.reward_extra) == (0.5, {"turns": 2.0})
    ended = second_out[-1] in served.chat.eos_ids
    assert len(second_out) <= 4 and out.finish_reason == ("stop" if ended else "length"), "the engine's (max_tokens=4)"

    failed, router, sid = roll(served, "rewrite", on_history_rewrite="fail")
    error = openai_agents.RECORDED[sid][-1]
    assert isinstance(error, openai.BadRequestError) and error.code == "history_rewrite"
    assert len(router.requests) == 1 and failed.prompt_ids == first_ids and failed.response_ids == first_out
    assert (failed.finish_reason, failed.reward) == ("history_rewrite", 0.0)


@pytest.mark.parametrize("in_process", [True, False])
def test_streaming_log_probs_and_models(served: Served, in_process: bool) -> None:
    out, _, sid = roll(served, "stream", in_process=in_process)
    *events, listed = openai_agents.RECORDED[sid]
    assert [m.id for m in listed.data] == ["megarl"]
    assert events[0].choices[0].delta.tool_calls[0].function.name == "check_answer"
    assert events[-1].choices[0].finish_reason == "tool_calls"
    logprobs = [entry.logprob for entry in events[0].choices[0].logprobs.content]
    assert logprobs == out.response_logprobs and len(logprobs) == sum(out.response_mask) > 0


def test_failing_agents_end_only_their_own_samples(served: Served) -> None:
    async def go() -> list[AgentOutput]:
        router = RecordingRouter(served.url)
        agents = {"endless": 60, "broken": 60, "sleepy": 8, "check_answer": 60}  # agent: timeout_s
        loops = [
            OpenAIAgentLoop(_context(served, router, agent=f"{openai_agents.__name__}:{a}", max_turns=3, timeout_s=t))
            for a, t in agents.items()
        ]
        try:
            return list(await asyncio.gather(*(loop.run(_sample(served), GREEDY) for loop in loops)))
        finally:
            await asyncio.gather(*(loop.close() for loop in loops))
            await router.close()

    endless, broken, sleepy, fine = run(go())
    assert [o.finish_reason for o in (endless, broken, sleepy, fine)] == [
        "max_turns",
        "agent_error",
        "agent_timeout",
        "stop",
    ]
    assert [o.reward for o in (endless, broken, sleepy, fine)] == [0.0, 0.0, 0.0, 1.0]
    assert endless.metrics["openai/requests"] == 3 and endless.num_turns == 5, "3 model turns, 2 user deltas kept"
    assert all(sum(o.response_mask) > 0 for o in (broken, sleepy)), "the tokens before the failure are the row"
    assert (broken.metrics["openai/agent_errors"], sleepy.metrics["openai/agent_timeouts"]) == (1.0, 1.0)
