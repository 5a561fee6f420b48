"""Agent-loop parts without an engine: tool-call parsing, the chat delta, truncation, post-processing,
the loop registry and its contract, tool and interaction configs, the GSM8K tool and interaction."""

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import compose_config
from transformers import AutoTokenizer

from megarl.agents.base import AgentLoop, AgentOutput
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.interactions.base import load_interactions
from megarl.agents.interactions.gsm8k import Gsm8kInteraction
from megarl.agents.postprocess import RoutingLayout, to_batch
from megarl.agents.registry import resolve_agent_loop
from megarl.agents.single_turn import SingleTurnAgentLoop
from megarl.agents.tool_loop import ToolAgentLoop, _truncate_text
from megarl.agents.tool_parsers import HermesParser, ToolCall, make_parser
from megarl.agents.tools.config import load_tools
from megarl.agents.tools.gsm8k import CheckAnswerTool
from megarl.agents.worker import AgentSettings, row_sample, sampling_for
from megarl.assets import asset_path
from megarl.batch import NO_RECORD
from megarl.config.rollout import MultiTurnConfig, RolloutConfig, multi_turn_problems
from megarl.data import RLDataset, collate_prompts, load_tool_schemas


@pytest.fixture(scope="module")
def chat() -> ChatTokens:
    return ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))


def test_hermes_parses_calls_and_reports_malformed_ones() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "c", "arguments": 3}</tool_call> tail <tool_call>{"name": "d"'
    )
    parsed = HermesParser().parse(text)
    assert parsed.calls == [ToolCall(name="a", arguments={"x": 1}), ToolCall(name="b", arguments={"y": 2})]
    assert len(parsed.errors) == 4
    assert "not valid JSON" in parsed.errors[0] and "JSON object" in parsed.errors[1]
    assert "arguments of the call to 'c'" in parsed.errors[2] and "no closing" in parsed.errors[3]
    assert parsed.content == "Let me check.\n\n tail"
    assert HermesParser().parse("just text").calls == [] and HermesParser().parse("just text").errors == []


class NoParse:
    """Not a parser: it has no parse()."""


def test_parser_registry_and_user_parsers() -> None:
    assert isinstance(make_parser("hermes"), HermesParser)
    assert isinstance(make_parser("megarl.agents.tool_parsers:HermesParser"), HermesParser)
    with pytest.raises(ValueError, match="tool_call_parser='qwen9' is unknown"):
        make_parser("qwen9")
    with pytest.raises(ValueError, match="no parse"):
        make_parser(f"{__name__}:NoParse")


def test_chat_delta_continues_a_rendering(chat: ChatTokens) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt = chat.encode(messages, add_generation_prompt=True)
    reply = [*chat.tokenizer.encode("hello there", add_special_tokens=False), chat.turn_close[0]]
    tools = [{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}]
    full = chat.encode([*messages, {"role": "assistant", "content": "hello there"}, *tools], add_generation_prompt=True)
    assert prompt + reply + chat.delta(tools, model_ended_with_eos=True) == full
    cut = reply[:-1]
    assert prompt + cut + chat.delta(tools, model_ended_with_eos=False) == full, "the loop closes a turn without EOS"
    assert chat.tokenizer.decode(chat.delta(tools, True)).count("<|im_start|>user") == 1, "tool messages share a turn"
    assert "system" not in chat.tokenizer.decode(chat.delta(tools, True)), "no repeated system prompt"
    assert chat.decode_reply(reply) == "hello there"


def test_chat_tokens_refuses_a_template_without_eos() -> None:
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="without an EOS"):
        ChatTokens(tokenizer)


@pytest.mark.parametrize(
    ("side", "want"),
    [("left", "...(truncated)...56789"), ("right", "01234...(truncated)..."), ("middle", "01...(truncated)...789")],
)
def test_tool_response_truncation(side: str, want: str) -> None:
    text = "0123456789" * 3
    assert _truncate_text(text, 22, side) == want and len(want) == 22
    assert _truncate_text("short", 22, side) == "short"


def test_postprocess_layout() -> None:
    outputs = [
        AgentOutput(
            prompt_ids=[5, 6, 7],
            response_ids=[8, 9, 10, 11],
            response_mask=[1, 0, 0, 1],
            response_logprobs=[-0.5, 0.0, 0.0, -0.25],
            reward=2.0,
            num_turns=3,
            metrics={"x": 1.0},
        ),
        AgentOutput(prompt_ids=[4], response_ids=[12], response_mask=[1], response_logprobs=[-1.0]),
    ]
    batch = to_batch(outputs, prompt_length=4, response_length=5, pad_token_id=0)
    assert batch["prompts"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 4]]
    assert batch["responses"].tolist() == [[8, 9, 10, 11, 0], [12, 0, 0, 0, 0]]
    assert batch["input_ids"].tolist()[0] == [0, 5, 6, 7, 8, 9, 10, 11, 0]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist()[1] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert batch["position_ids"].tolist()[0][:8] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert batch["response_mask"].tolist() == [[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert torch.equal(batch["rollout_log_probs"], torch.tensor([[-0.5, 0, 0, -0.25, 0], [-1.0, 0, 0, 0, 0]]))
    assert batch["rm_scores"].tolist() == [[0, 0, 0, 2.0, 0], [0, 0, 0, 0, 0]]
    assert batch["num_turns"].tolist() == [3, 1] and list(batch["loop_reward"]) == [2.0, None]
    with pytest.raises(ValueError, match="max_prompt_length=2"):
        to_batch(outputs, prompt_length=2, response_length=5, pad_token_id=0)


@pytest.mark.parametrize(("model", "moe_layers"), [("tiny_glm4_moe", (1,)), ("tiny_deepseek_v3", (1, 2, 3))])
def test_routed_experts_column_keeps_the_moe_layers(model: str, moe_layers: tuple[int, ...]) -> None:
    """A dense-first model (`first_k_dense_replace=1`): the engine answers every decoder layer (the dense one 0),
    the column keeps the MoE layers' experts in decoder order, in int8 (4 and 8 experts), placed like input_ids, -1
    where there is no record (padding, the last token, a row the engine forwarded nothing of)."""
    layout = RoutingLayout.of(str(asset_path(f"models/{model}")))
    assert layout.moe_layers == moe_layers
    engine = torch.randint(0, layout.num_experts, (3, layout.num_layers, 2), generator=torch.Generator().manual_seed(0))
    engine[:, 0] = 0  # the dense layer, as SGLang leaves it
    routed = AgentOutput(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        response_mask=[1, 1],
        response_logprobs=[0.0, 0.0],
        routed_experts=engine.flatten(1).int(),  # prompt ‖ response but the last token
    )
    unrouted = AgentOutput(prompt_ids=[5], response_ids=[6], response_mask=[1], response_logprobs=[0.0])
    column = to_batch([routed, unrouted], 3, 2, pad_token_id=0, routing=layout)["routed_experts"]
    assert column.dtype == torch.int8 and column.shape == (2, 5, len(moe_layers) * 2)
    assert torch.equal(column[0, 1:4], engine[:, list(moe_layers)].flatten(1).to(torch.int8))
    assert (column[0, [0, 4]] == NO_RECORD).all() and (column[1] == NO_RECORD).all()


class EchoLoop(AgentLoop):
    """A user loop: answers with its prompt."""

    async def run(self, sample: Any, sampling: Any) -> AgentOutput:
        ids = list(sample.prompt_ids)
        return AgentOutput(
            prompt_ids=ids, response_ids=ids, response_mask=[1] * len(ids), response_logprobs=[0.0] * len(ids)
        )


def test_agent_loop_registry_and_contract() -> None:
    assert resolve_agent_loop("single_turn") is SingleTurnAgentLoop
    assert resolve_agent_loop("tool_agent") is ToolAgentLoop
    assert resolve_agent_loop(f"{__name__}:EchoLoop") is EchoLoop
    for cls in (SingleTurnAgentLoop, ToolAgentLoop, EchoLoop):
        assert inspect.iscoroutinefunction(cls.run), f"{cls.__name__}.run must be async"
        assert list(inspect.signature(cls.run).parameters) == ["self", "sample", "sampling"]
    with pytest.raises(ValueError, match="'react' is unknown"):
        resolve_agent_loop("react")
    with pytest.raises(ValueError, match="not an AgentLoop subclass"):
        resolve_agent_loop("megarl.agents.tools.gsm8k:CheckAnswerTool")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_agent_loop("nowhere.module:Loop")


def test_tool_config_loading(tmp_path: Path) -> None:
    tools = load_tools(asset_path("tools/gsm8k.yaml"))
    assert list(tools) == ["check_answer"] and isinstance(tools["check_answer"], CheckAnswerTool)
    schema = {"type": "function", "function": {"name": "t"}}
    cases = {
        "needs class_name": {"tools": [{"tool_schema": schema}]},
        "not a BaseTool subclass": {
            "tools": [{"class_name": "megarl.agents.tools.base:ToolResult", "tool_schema": schema}]
        },
        "defined twice": {"tools": [{"class_name": "megarl.agents.tools.base:BaseTool", "tool_schema": schema}] * 2},
        "function.name": {"tools": [{"class_name": "megarl.agents.tools.base:BaseTool", "tool_schema": {}}]},
        "a `tools:` list": {"tool": []},
    }
    for message, spec in cases.items():
        path = tmp_path / "t.yaml"
        path.write_text(yaml.safe_dump(spec))
        with pytest.raises(ValueError, match=message):
            load_tools(path)


def test_interaction_config_loading(tmp_path: Path) -> None:
    path = tmp_path / "i.yaml"
    entry = {
        "name": "g",
        "class_name": "megarl.agents.interactions.gsm8k.Gsm8kInteraction",
        "config": {"max_attempts": 1},
    }
    path.write_text(yaml.safe_dump({"interactions": [entry]}))
    found = load_interactions(path)
    assert isinstance(found["g"], Gsm8kInteraction) and found["g"].max_attempts == 1
    path.write_text(yaml.safe_dump({"interactions": [entry, entry]}))
    with pytest.raises(ValueError, match="defined twice"):
        load_interactions(path)


def test_check_answer_tool_and_gsm8k_interaction() -> None:
    async def go() -> tuple[list[Any], list[Any]]:
        tool = CheckAnswerTool({"penalty": -0.1}, {"function": {"name": "check_answer"}})
        await tool.create("i", ground_truth="18")
        results = [await tool.execute("i", {"answer": a}) for a in ("17", "18.0", None)]
        reward = await tool.calc_reward("i")
        await tool.release("i")
        with pytest.raises(ValueError, match="ground_truth"):
            await tool.create("j")
        teacher = Gsm8kInteraction({"max_attempts": 2})
        await teacher.start_interaction("k", ground_truth="4")
        replies = [await teacher.generate_response("k", [{"role": "assistant", "content": c}]) for c in ("#### 5", "4")]
        return [*results, reward], replies

    (wrong, right, bad, reward), replies = asyncio.run(go())
    assert "wrong" in wrong.text and wrong.reward == 0.0 and "correct" in right.text and right.reward == -0.1
    assert bad.text.startswith("Error") and reward == 1.0
    assert [r.done for r in replies] == [False, True] and "could not find" in replies[1].text


def test_multi_turn_config_problems(tmp_path: Path) -> None:
    cfg = RolloutConfig(
        num_agent_workers=0,
        multi_turn=MultiTurnConfig(
            tool_config_path=str(tmp_path / "none.yaml"),
            max_assistant_turns=0,
            max_parallel_calls=0,
            tool_response_truncate_side="up",
            tool_timeout_s=0,
        ),
    )
    problems = "\n".join(multi_turn_problems(cfg))
    for key in (
        "tool_config_path",
        "max_assistant_turns=0",
        "max_parallel_calls=0",
        "truncate_side='up'",
        "tool_timeout_s=0",
        "num_agent_workers=0",
    ):
        assert key in problems
    assert multi_turn_problems(RolloutConfig()) == []


def test_sampling_for_training_and_validation() -> None:
    cfg = RolloutConfig(temperature=0.8, top_p=0.9, top_k=50)
    train, val = sampling_for(cfg, validate=False), sampling_for(cfg, validate=True)
    assert (train.temperature, train.top_p, train.top_k) == (0.8, 0.9, 50)
    assert (val.temperature, val.top_p, val.top_k) == (0.0, 1.0, -1), "rollout.val defaults to greedy"


def test_dataset_rows_become_agent_samples(small_parquet: dict[str, Path]) -> None:
    """The columns collate_prompts writes are the ones agent workers read."""
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    dataset = RLDataset(
        [str(small_parquet["tools"])],
        tokenizer,
        max_prompt_length=512,
        tool_schemas=load_tool_schemas(str(asset_path("tools/gsm8k.yaml"))),
        max_samples=2,
    )
    rows = collate_prompts([dataset[0], dataset[1]], tokenizer.pad_token_id, 512)
    sample = row_sample(rows, 1, seed=7)
    assert sample.prompt_ids == dataset[1]["prompt_ids"] and sample.messages == dataset[1]["raw_prompt"]
    assert rows["agent_name"][1] == "tool_agent" and sample.seed == 7
    assert sample.tools_kwargs == {
        "check_answer": {"create_kwargs": {"ground_truth": dataset[1]["reward_model"]["ground_truth"]}}
    }
    assert sample.interaction_kwargs is None


def test_agent_settings_from_config() -> None:
    cfg = compose_config(
        "+experiment=gsm8k_tools", "data.max_response_length=96", "rollout.multi_turn.max_assistant_turns=3"
    )
    settings = AgentSettings.from_config(cfg)
    assert (settings.prompt_length, settings.response_length) == (512, 96)
    assert settings.rollout.multi_turn.max_assistant_turns == 3
    assert settings.rollout.multi_turn.tool_config_path == str(asset_path("tools/gsm8k.yaml"))
    assert Path(settings.tokenizer_path, "tokenizer.json").is_file()
    assert settings.routing is None
    r3 = AgentSettings.from_config(compose_config("+experiment=tiny_moe_ep2"))
    assert r3.routing == RoutingLayout(num_layers=2, moe_layers=(0, 1), num_experts=4)
