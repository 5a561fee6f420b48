"""Agents written only against the `openai` client, trained by megarl as they are (`agent_loop=openai`).

    PYTHONPATH=. megarl-train +experiment=openai_agent          # `run` on GSM8K with a calculator tool

megarl hands each sample's agent an `openai.AsyncOpenAI` whose base URL is that sample's session; nothing here
imports megarl. `run` is a calculator agent: it offers one tool, executes the calls the model makes, feeds the
results back, and stops when the model answers without a call; its return is the reward. `chat` is the plainest
agent: one completion of the prompt, scored by the task's reward function (it returns None).
"""

import ast
import json
import operator
import re
from typing import Any

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses) and return the number.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (48 / 2) * 3"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 4
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


async def run(client: Any, sample: dict[str, Any]) -> float:
    """Up to MAX_TURNS completions; each tool call is answered with the calculator's result. Reward 1.0 when the last
    number of the final answer is the sample's ground truth."""
    messages = list(sample["messages"])
    answer = ""
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        choice = response.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        answer = choice.message.content or ""
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    return float(last_number(answer) == str(sample.get("ground_truth")))


async def chat(client: Any, sample: dict[str, Any]) -> None:
    """One completion of the prompt; the reward function of the row's data source scores it."""
    await client.chat.completions.create(model="policy", messages=sample["messages"])


def calculate(arguments: str) -> str:
    """The calculator's answer to one call's JSON arguments, or an error the model reads."""
    try:
        expression = json.loads(arguments)["expression"]
        value = _evaluate(ast.parse(str(expression), mode="eval").body)
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, OverflowError) as err:
        return f"Error: {type(err).__name__}: {err}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / ** are allowed, not {type(node).__name__}")


def last_number(text: str) -> str:
    """The last number in `text`, commas dropped ("1,200.0" → "1200"), or ""."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not numbers:
        return ""
    number = numbers[-1].replace(",", "")
    return number.removesuffix(".0") if number.endswith(".0") else number
