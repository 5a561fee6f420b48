"""Agents written only against the `openai` client, for the session-server tests (`agents.openai.agent=...`)."""

import asyncio
import json
from typing import Any

import openai

RECORDED: dict[str, list[Any]] = {}
"""Per sample id, what an agent saw (responses, errors) for the tests to inspect."""


async def check_answer(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """ToolAgentLoop's behaviour on the scripted `two_calls` conversation, as a client: each call to check_answer is
    answered the way CheckAnswerTool answers; the reward is 1.0 when the last answer checked was right."""
    messages, right = list(sample["messages"]), 0.0
    seen = RECORDED.setdefault(sample["sample_id"], [])
    for _ in range(8):
        response = await client.chat.completions.create(model="any", messages=messages, tools=sample["tools"])
        seen.append(response)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if response.choices[0].finish_reason != "tool_calls":
            break
        for call in message.tool_calls or []:
            answer = json.loads(call.function.arguments)["answer"]
            right = float(answer == sample["ground_truth"])
            verdict = "correct" if right else "wrong"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"The answer {answer} is {verdict}."})
    return right


async def rewrite(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> dict[str, float]:
    """One turn, then a request that rewrites the history (the first user message edited, the reply dropped)."""
    seen = RECORDED.setdefault(sample["sample_id"], [])
    first = await client.chat.completions.create(model="any", messages=sample["messages"], tools=sample["tools"])
    seen.append(first)
    edited = [*sample["messages"][:-1], {"role": "user", "content": "What is 3 + 4? Answer at once."}]
    try:
        seen.append(await client.chat.completions.create(model="any", messages=edited, max_tokens=4))
    except openai.BadRequestError as err:
        seen.append(err)
        raise
    return {"score": 0.5, "turns": 2.0}


async def stream(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """Streamed, with log-probs: the chunks are kept for the test."""
    events = await client.chat.completions.create(
        model="any", messages=sample["messages"], tools=sample["tools"], stream=True, logprobs=True
    )
    RECORDED[sample["sample_id"]] = [chunk async for chunk in events]
    RECORDED[sample["sample_id"]].append(await client.models.list())
    return 1.0


async def endless(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """Asks again and again, past agents.openai.max_turns."""
    messages = list(sample["messages"])
    while True:
        response = await client.chat.completions.create(model="any", messages=messages, max_tokens=2)
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]


async def broken(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """One turn, then fails."""
    await client.chat.completions.create(model="any", messages=sample["messages"], max_tokens=3)
    raise RuntimeError("the agent broke")


async def sleepy(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """One turn, then outlives agents.openai.timeout_s."""
    await client.chat.completions.create(model="any", messages=sample["messages"], max_tokens=3)
    await asyncio.sleep(60)
    return 1.0
