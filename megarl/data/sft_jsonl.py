"""Chat conversations from JSONL → SFT parquet rows (`megarl-preprocess sft`; the row layout: megarl/data/sft.py).

`messages` is written as a list of message structs with tool-call arguments as JSON strings (OpenAI's form; parquet
would otherwise merge the argument keys of every call and fill the ones a call lacks with nulls), `tools` as a JSON
string ("[]" for none) so every file has one schema.
"""

import json
from pathlib import Path
from typing import Any

from megarl.data.arith import write_rows
from megarl.data.checks import DataError
from megarl.data.sft import messages_problem, parse_tools


def preprocess_jsonl(input_path: Path, output_path: Path) -> int:
    """JSONL conversations (`{"messages": [...], "tools": [...]}` a line, tools optional) → SFT parquet rows;
    returns the row count. Raises ValueError naming the file and line of a bad one."""
    if not input_path.is_file():
        raise FileNotFoundError(f"--input {input_path} does not exist")
    rows = []
    with input_path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(jsonl_row(json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{input_path}:{line_no}: not valid JSON ({err})") from err
            except DataError as err:
                raise ValueError(f"{input_path}:{line_no}: {err}") from err
    if not rows:
        raise ValueError(f"--input {input_path} holds no conversations")
    return write_rows(output_path, rows)


def jsonl_row(example: Any) -> dict[str, Any]:
    """The parquet row of one JSONL conversation; DataError when it is not one."""
    if not isinstance(example, dict) or "messages" not in example:
        raise DataError(f'expected an object {{"messages": [...], "tools": [...]}}, got {example!r:.80}')
    problem = messages_problem(example["messages"])
    if problem is not None:
        raise DataError(problem)
    tools = parse_tools(example.get("tools"))
    return {
        "messages": [_with_string_arguments(message) for message in example["messages"]],
        "tools": json.dumps(tools or [], ensure_ascii=False),
    }


def _with_string_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with each tool call's `function.arguments` as a JSON string (as the template's `tojson` writes)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return message | {"tool_calls": [_call_with_string_arguments(call) for call in calls]}


def _call_with_string_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    if isinstance(function.get("arguments"), str):
        return call
    arguments = json.dumps(function.get("arguments", {}), ensure_ascii=False)
    return call | {"function": function | {"arguments": arguments}}
