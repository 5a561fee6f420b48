"""Agent loops end to end against a real embedded engine serving a tiny model trained on scripts.

The model was fit on each script's ids as the chat template renders the whole conversation; the
loops must reproduce those ids token by token. `test_token_in_token_out_without_drift` checks every
request's context directly: previous context + the model's own ids + the template delta of the new
messages, never a re-encoding.
"""

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cases.agent_cases import (
    CHECK_SCHEMA,
    EXPLODE_SCHEMA,
    WRONG_AGAIN,
    BrokenInteraction,
    ColocatedManager,
    ExplodingTool,
    RecordingRouter,
    Script,
    make_scripts,
    scripted_model,
    user,
)
from cases.engine_cases import engine_client, run, start_engine
from transformers import AutoTokenizer

from megarl.agents.base import AgentContext, AgentOutput, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.interactions.gsm8k import Gsm8kInteraction
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.agents.tool_parsers import HermesParser
from megarl.agents.tools.gsm8k import CheckAnswerTool
from megarl.agents.worker import AgentSettings
from megarl.assets import asset_path
from megarl.batch import Batch
from megarl.config.rollout import MultiTurnConfig, RolloutConfig
from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class Served:
    url: str
    chat: ChatTokens
    scripts: dict[str, Script]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    scripts = make_scripts()
    root = tmp_path_factory.mktemp("scripted")
    server, url = start_engine(scripted_model(tmp_path_factory, chat), root, "--enable-weights-cpu-backup")
    try:
        yield Served(url, chat, scripts)
    finally:
        server.stop()


def roll(
    served: Served, name: str, response_length: int = 400, interaction: str = "gsm8k", **multi_turn: Any
) -> tuple[AgentOutput, RecordingRouter]:
    script = served.scripts[name]

    async def go() -> tuple[AgentOutput, RecordingRouter]:
        router = RecordingRouter(served.url)
        context = AgentContext(
            router=router,
            chat=served.chat,
            response_length=response_length,
            multi_turn=MultiTurnConfig(**({"max_parallel_calls": 2} | multi_turn)),
            tools={"check_answer": CheckAnswerTool({}, CHECK_SCHEMA), "explode": ExplodingTool({}, EXPLODE_SCHEMA)},
            interactions={"gsm8k": Gsm8kInteraction({"max_attempts": 3}), "broken": BrokenInteraction({})},
            parser=HermesParser(),
        )
        names = [t["function"]["name"] for t in script.tools or []]
        sample = AgentSample(
            sample_id=name,
            prompt_ids=script.prompt_ids(served.chat),
            messages=script.prompt,
            tools_kwargs={n: {"create_kwargs": {"ground_truth": "7" if name == "two_calls" else "3"}} for n in names},
            interaction_kwargs={"name": interaction, "ground_truth": "4"} if name == "interaction" else None,
        )
        try:
            return await ToolAgentLoop(context).run(sample, GREEDY), router
        finally:
            await router.close()

    return run(go())


def expected(served: Served, name: str, num_turns: int | None = None) -> tuple[list[int], list[int]]:
    """The script's response ids through `num_turns` turns and its model-token mask."""
    script = served.scripts[name]
    prompt = script.prompt_ids(served.chat)
    ids, mask = script.training_ids(served.chat)
    if num_turns is not None:
        ids = script.full_ids(served.chat, num_turns)[:-1]  # the last model turn's EOS ends it, not "\n"
    return ids[len(prompt) :], mask[len(prompt) : len(ids)]


def test_tool_trajectory_token_layout(served: Served) -> None:
    out, _ = roll(served, "two_calls")
    want_ids, want_mask = expected(served, "two_calls")
    assert len(out.response_ids) == len(want_ids)
    for i, (got, want) in enumerate(zip(out.response_ids, want_ids, strict=True)):
        assert got == want, f"token {i}: {got} != {want} ({served.chat.tokenizer.decode(want_ids[: i + 1])[-60:]!r})"
    assert out.response_mask == want_mask
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 0)
    model_logprobs = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m]
    assert all(lp <= 0.0 for lp in model_logprobs) and any(lp < 0.0 for lp in model_logprobs)
    assert (out.finish_reason, out.num_turns) == ("stop", 5)
    assert out.reward == 1.0, "CheckAnswerTool.calc_reward: the last answer checked (7) is right"
    assert out.metrics["num_tool_calls"] == 2 and out.metrics["num_tool_errors"] == 0
    assert out.metrics["tool/check_answer/correct"] == 0.5
    assert [m["role"] for m in out.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]


def test_token_in_token_out_without_drift(served: Served) -> None:
    script = served.scripts["two_calls"]
    out, router = roll(served, "two_calls")
    prompt = script.prompt_ids(served.chat)
    assert len(router.requests) == 3
    ids = list(prompt)
    for k, (request, generated) in enumerate(router.requests):
        assert request == ids, f"request {k} is not the previous context plus the previous turn's ids"
        ids += generated
        if k < 2:
            tool_message = script.turns[2 * k + 1]
            assert isinstance(tool_message, list)
            ids += served.chat.delta(tool_message, model_ended_with_eos=True)
    assert prompt + out.response_ids == ids
    assert [*ids, served.chat.turn_close[-1]] == script.full_ids(served.chat), "one-shot rendering of the whole chat"


def test_malformed_call_is_survived(served: Served) -> None:
    out, _ = roll(served, "malformed")
    assert out.response_ids == expected(served, "malformed")[0]
    assert "not valid JSON" in out.messages[3]["content"]
    assert out.metrics["num_parse_errors"] == 1 and out.metrics["num_tool_calls"] == 0
    assert out.finish_reason == "stop" and out.reward is None, "no tool ran, so the loop gives no reward"


def test_crashing_tool_is_survived(served: Served) -> None:
    out, _ = roll(served, "crash")
    assert out.response_ids == expected(served, "crash")[0]
    assert out.metrics["num_tool_errors"] == 1 and out.finish_reason == "stop"
    assert out.reward == 0.0, "explode was created, and its calc_reward is 0"


def test_tool_error_can_end_the_trajectory(served: Served) -> None:
    out, router = roll(served, "crash", continue_on_tool_error=False)
    assert out.response_ids == expected(served, "crash", num_turns=1)[0]
    assert out.finish_reason == "tool_error" and all(out.response_mask) and len(router.requests) == 1


def test_parallel_calls_and_unknown_tool(served: Served) -> None:
    out, _ = roll(served, "parallel")
    assert out.response_ids == expected(served, "parallel")[0]
    assert out.metrics["num_tool_calls"] == 2 and out.metrics["num_tool_errors"] == 1
    one, _ = roll(served, "parallel", max_parallel_calls=1)
    assert one.metrics["num_tool_calls"] == 1 and "no tool named" not in str(one.messages)


@pytest.mark.parametrize(
    ("limit", "value", "reason"),
    [("max_assistant_turns", 2, "max_assistant_turns"), ("max_user_turns", 1, "max_user_turns")],
)
def test_turn_limits_stop_after_a_model_turn(served: Served, limit: str, value: int, reason: str) -> None:
    out, router = roll(served, "two_calls", **{limit: value})
    assert out.response_ids == expected(served, "two_calls", num_turns=3)[0]
    assert out.finish_reason == reason and out.num_turns == 3 and len(router.requests) == 2
    assert out.response_mask[-1] == 1


def test_response_budget_never_ends_on_a_tool_turn(served: Served) -> None:
    first, _ = expected(served, "two_calls", num_turns=1)
    out, router = roll(served, "two_calls", response_length=len(first) + 5)
    assert out.response_ids == first and out.finish_reason == "length" and len(router.requests) == 1
    tool_message = served.scripts["two_calls"].turns[1]
    assert isinstance(tool_message, list)
    through_tool = first + served.chat.delta(tool_message, model_ended_with_eos=True)
    cut, router = roll(served, "two_calls", response_length=len(through_tool) + 3)
    assert len(cut.response_ids) == len(through_tool) + 3 and cut.response_mask[-3:] == [1, 1, 1]
    assert cut.finish_reason == "length" and router.requests[-1][1] == cut.response_ids[-3:]


def test_interaction_turns(served: Served) -> None:
    out, _ = roll(served, "interaction")
    want_ids, want_mask = expected(served, "interaction")
    assert out.response_ids == want_ids and out.response_mask == want_mask
    assert out.messages[-2] == user(WRONG_AGAIN)
    assert (out.finish_reason, out.reward, out.num_turns) == ("interaction_done", 1.0, 3)
    assert out.metrics["interaction/attempts"] == 1.5


def test_failing_interaction_ends_only_its_trajectory(served: Served) -> None:
    out, _ = roll(served, "interaction", interaction="broken")
    assert out.response_ids == expected(served, "interaction", num_turns=1)[0]
    assert out.finish_reason == "interaction_error" and out.reward == 0.0


def test_rollout_manager_across_ray_workers(served: Served, local_ray: None, tmp_path: Path) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        yaml.safe_dump(
            {"tools": [{"class_name": f"{CheckAnswerTool.__module__}.CheckAnswerTool", "tool_schema": CHECK_SCHEMA}]}
        )
    )
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text(
        yaml.safe_dump(
            {
                "interactions": [
                    {
                        "name": "gsm8k",
                        "class_name": f"{Gsm8kInteraction.__module__}.Gsm8kInteraction",
                        "config": {"max_attempts": 3},
                    }
                ]
            }
        )
    )
    names = ["two_calls", "interaction", "malformed", "single"]
    scripts = [served.scripts[n if n != "single" else "interaction"] for n in names]
    batch = Batch.from_dict(
        non_tensors={
            "raw_prompt_ids": [s.prompt_ids(served.chat) for s in scripts],
            "raw_prompt": [s.prompt for s in scripts],
            "agent_name": ["tool_agent", "tool_agent", "tool_agent", "single_turn"],
            "tools_kwargs": [{"check_answer": {"create_kwargs": {"ground_truth": "7"}}}, {}, {"check_answer": {}}, {}],
            "extra_info": [{}, {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "4"}}, {}, {}],
        }
    )
    rollout = RolloutConfig(
        num_agent_workers=2,
        multi_turn=MultiTurnConfig(tool_config_path=str(tools), interaction_config_path=str(interactions)),
    )
    settings = AgentSettings(
        rollout=rollout, tokenizer_path=str(asset_path("tokenizer")), prompt_length=320, response_length=200
    )
    manager = ColocatedManager(settings, [served.url], num_workers=2)
    try:
        out, metrics = manager.rollout(batch, validate=True)
        assert manager.asleep, "colocated: the engines sleep after generating"
        with pytest.raises(EngineError, match="released"):
            run(_generate_directly(served.url, [1, 2, 3]))
        again, _ = manager.rollout(batch, validate=True)
    finally:
        if manager.asleep:
            manager.wake()  # the engine serves the other tests of this module
        manager.close()
    assert torch.equal(again["responses"], out["responses"]), "woken engines kept their weights"
    wants = [expected(served, n) for n in names[:3]] + [expected(served, "interaction", num_turns=1)]
    for i, (want_ids, want_mask) in enumerate(wants):
        prompt = scripts[i].prompt_ids(served.chat)
        assert (
            out["prompts"][i, 320 - len(prompt) :].tolist() == prompt
            and out["attention_mask"][i, : 320 - len(prompt)].sum() == 0
        )
        assert out["responses"][i, : len(want_ids)].tolist() == want_ids
        assert out["response_mask"][i].tolist() == want_mask + [0] * (200 - len(want_mask))
        assert out["attention_mask"][i, 320:].sum() == len(want_ids)
    last = [len(expected(served, n)[0]) - 1 for n in names[:2]]
    assert out["rm_scores"][0, last[0]] == 1.0 and out["rm_scores"][1, last[1]] == 1.0
    assert out["rm_scores"].count_nonzero() == 2
    assert list(out["loop_reward"]) == [1.0, 1.0, None, None], "malformed: no tool ran"
    assert out["num_turns"].tolist() == [5, 3, 3, 1]
    assert list(out["finish_reason"]) == ["stop", "interaction_done", "stop", "stop"]
    assert metrics["rollout/finish/stop"] == 0.75 and metrics["rollout/num_turns/max"] == 5


async def _generate_directly(url: str, ids: list[int]) -> None:
    client = engine_client(url)
    try:
        await client.generate(ids, SamplingParams(max_new_tokens=2))
    finally:
        await client.close()


def test_tokens_per_turn_cap(served: Served) -> None:
    out, router = roll(served, "two_calls", max_new_tokens_per_turn=5, max_assistant_turns=2)
    first, _ = expected(served, "two_calls", num_turns=1)
    eos = served.chat.turn_close[0]
    assert out.response_ids[:6] == [*first[:5], eos], "the cut turn is closed by the loop"
    assert out.response_mask[:6] == [1] * 5 + [0], "the closing EOS is not the model's token"
    assert out.metrics["num_parse_errors"] == 1, "the cut call has no closing tag"
    assert out.finish_reason == "max_assistant_turns" and [len(g) for _, g in router.requests] == [5, 5]
