"""Scripted conversations and a tiny model trained to follow them, for agent-loop tests.

`train_scripted_model` fits tiny_dense (widened) until its greedy choice is right at every model
token of every script, so an engine serving it replays the scripts given the scripts' contexts.
"""

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from cases.engine_cases import router_of
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.interactions.base import BaseInteraction, InteractionReply
from megarl.agents.manager import RolloutManager
from megarl.agents.tool_parsers import HermesParser, ParsedTurn, ToolCall
from megarl.agents.tools.base import BaseTool, ToolResult
from megarl.agents.worker import AgentSettings
from megarl.assets import asset_path
from megarl.batch import Batch
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult

CHECK_SCHEMA = {
    "type": "function",
    "function": {
        "name": "check_answer",
        "description": "Check an answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}
EXPLODE_SCHEMA = {
    "type": "function",
    "function": {"name": "explode", "description": "Always fails.", "parameters": {"type": "object"}},
}
SYSTEM = {"role": "system", "content": "Use the tools."}


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@dataclass(kw_only=True)
class Script:
    """A conversation: the prompt messages, then alternating model replies and the tool/user messages after them."""

    prompt: list[dict[str, Any]]
    turns: list[str | list[dict[str, Any]]]
    tools: list[dict[str, Any]] | None = None

    def messages(self, num_turns: int | None = None) -> list[dict[str, Any]]:
        out = list(self.prompt)
        for turn in self.turns[:num_turns]:
            out += [{"role": "assistant", "content": turn}] if isinstance(turn, str) else turn
        return out

    def prompt_ids(self, chat: ChatTokens) -> list[int]:
        return chat.encode(self.prompt, add_generation_prompt=True, tools=self.tools)

    def full_ids(self, chat: ChatTokens, num_turns: int | None = None) -> list[int]:
        """The whole conversation rendered and tokenized at once (the oracle for token-in/token-out)."""
        return chat.encode(self.messages(num_turns), add_generation_prompt=False, tools=self.tools)

    def training_ids(self, chat: ChatTokens) -> tuple[list[int], list[int]]:
        """Ids and a 0/1 mask of the model's own tokens (replies and their EOS), built turn by turn."""
        ids = self.prompt_ids(chat)
        mask = [0] * len(ids)
        so_far = list(self.prompt)
        for turn in self.turns:
            if isinstance(turn, str):
                reply = [*chat.tokenizer.encode(turn, add_special_tokens=False), min(chat.eos_ids)]
                ids, mask = ids + reply, mask + [1] * len(reply)
                so_far.append({"role": "assistant", "content": turn})
            else:
                rendered = chat.encode([*so_far, *turn], add_generation_prompt=True, tools=self.tools)
                ids, mask = ids + rendered[len(ids) :], mask + [0] * (len(rendered) - len(ids))
                so_far += turn
        return ids, mask


def tool(text: str) -> list[dict[str, Any]]:
    return [{"role": "tool", "content": text}]


MALFORMED = '<tool_call>\n{"name": "check_answer", "arguments": {"answer": \n</tool_call>'
WRONG_AGAIN = "Your answer is wrong. Please try again."


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def make_scripts() -> dict[str, Script]:
    [malformed_error] = HermesParser().parse(MALFORMED).errors
    return {
        "two_calls": Script(
            prompt=[SYSTEM, user("What is 3 + 4?")],
            tools=[CHECK_SCHEMA],
            turns=[
                call("check_answer", answer="6"),
                tool("The answer 6 is wrong."),
                call("check_answer", answer="7"),
                tool("The answer 7 is correct."),
                "#### 7",
            ],
        ),
        "malformed": Script(
            prompt=[SYSTEM, user("What is 5 + 5?")],
            tools=[CHECK_SCHEMA],
            turns=[MALFORMED, tool(malformed_error), "#### 10"],
        ),
        "crash": Script(
            prompt=[SYSTEM, user("What is 1 + 0?")],
            tools=[CHECK_SCHEMA, EXPLODE_SCHEMA],
            turns=[call("explode"), tool("Error: the tool 'explode' failed: RuntimeError: boom"), "#### 1"],
        ),
        "parallel": Script(
            prompt=[SYSTEM, user("What is 1 + 2?")],
            tools=[CHECK_SCHEMA],
            turns=[
                call("check_answer", answer="3") + "\n" + call("nope"),
                tool("The answer 3 is correct.")
                + tool("Error: there is no tool named 'nope'; the tools are ['check_answer']."),
                "#### 3",
            ],
        ),
        "interaction": Script(prompt=[user("What is 2 + 2?")], turns=["#### 5", [user(WRONG_AGAIN)], "#### 4"]),
    }


def scripted_model(tmp_path_factory: Any, chat: ChatTokens) -> Path:
    """The model trained on `make_scripts()`, once per test session (`session_model`)."""
    return session_model(tmp_path_factory, "scripted_model", lambda path: train_scripted_model(
        list(make_scripts().values()), chat, path))  # fmt: skip


def session_model(tmp_path_factory: Any, name: str, train: Callable[[Path], Path]) -> Path:
    """`train(path)`'s model, once per test session: the first test module to ask trains it (under a file lock, so a
    module on another xdist worker waits for it) and the rest load it."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    path = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            staging = shared / f"{name}.staging"
            train(staging)
            staging.rename(path)
    return path


class RecordingRouter(Router):
    """A router that keeps every request's input ids and generated ids."""

    def __init__(self, url: str) -> None:
        super().__init__([router_of([url]).replicas[0].client])
        self.requests: list[tuple[list[int], list[int]]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *args: Any, **kwargs: Any
    ) -> list[GenerateResult]:
        results = await super().generate(input_ids, sampling, *args, **kwargs)
        self.requests.append((list(input_ids), list(results[0].output_ids)))
        return results


def train_scripted_model(scripts: list[Script], chat: ChatTokens, path: Path, hidden: int = 128) -> Path:
    """Fit a tiny qwen2 until greedy decoding reproduces every scripted reply; save it at `path`."""
    config = json.loads(asset_path("models/tiny_dense/config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    rows = [script.training_ids(chat) for script in scripts]
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (length - len(ids)) for ids, _ in rows])  # [b, s]
    mask = torch.tensor([m + [0] * (length - len(m)) for _, m in rows], dtype=torch.bool)  # [b, s]
    attention = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in rows])
    targets, target_mask = input_ids[:, 1:], mask[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(1000):
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]  # [b, s-1, v]
        if step % 10 == 0 and bool((logits.argmax(-1) == targets)[target_mask].all()):
            break
        loss = torch.nn.functional.cross_entropy(logits[target_mask], targets[target_mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the scripted model did not fit its scripts in 1000 steps")
    model.save_pretrained(path)
    return path


class ExplodingTool(BaseTool):
    """A tool whose every call raises."""

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        raise RuntimeError("boom")


class BrokenInteraction(BaseInteraction):
    """An interaction whose every reply raises."""

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionReply:
        raise RuntimeError("teacher is out")


class CallEveryTurnParser:
    """Reads every model turn as one `check_answer` call, so even a random model drives the tool loop's turns."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content=text, calls=[ToolCall(name="check_answer", arguments={"answer": "7"})])


class ColocatedManager(RolloutManager):
    """A manager that sleeps its engines after each rollout and wakes them before the next, as colocated engines
    are handed between rollout and trainer (in a run the actor's `ColocatedSequence` does it)."""

    def __init__(self, settings: AgentSettings, urls: list[str], num_workers: int = 1) -> None:
        super().__init__(settings, urls, num_workers=num_workers)
        self.engines = Fleet.connect(urls)
        self.asleep = False

    def rollout(self, batch: Batch, validate: bool = False, seed: int | None = None) -> tuple[Batch, dict[str, float]]:
        if self.asleep:
            self.wake()
        out = super().rollout(batch, validate, seed)
        self.sleep()
        return out

    def sleep(self) -> None:
        self.engines.wait(self.engines.release())
        self.asleep = True

    def wake(self) -> None:
        self.engines.wait(self.engines.resume())
        self.asleep = False

    def close(self) -> None:
        super().close()
        self.engines.shutdown()
