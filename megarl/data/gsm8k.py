"""GSM8K jsonl (`question`, `answer` ending in `#### N`) → RL prompt rows.

A row, as written to parquet::

    data_source  "openai/gsm8k"                  selects the reward function
    prompt       [{"role": "user", "content": …}]  chat messages (a system turn too with tools)
    ability      "math"
    reward_model {"style": "rule", "ground_truth": "18"}
    extra_info   {"split", "index", "question", "answer"}
                 + with tools: {"agent_name": "tool_agent",
                                "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": "18"}}}}
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megarl.rewards.gsm8k import gold_answer

DATA_SOURCE = "openai/gsm8k"
TOOL_NAME = "check_answer"
TOOL_AGENT = "tool_agent"
INSTRUCTION = 'Solve it step by step, then give the final answer on the last line as "#### <number>".'
TOOL_SYSTEM_PROMPT = (
    "You solve grade-school math problems. Reason step by step. Before you give your final answer, "
    f"call the `{TOOL_NAME}` tool with it at least once, and revise your work if the tool says it is wrong. "
    'End with the final answer on the last line as "#### <number>".'
)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a .jsonl file, naming the file and line on a parse error."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from err


def build_row(example: dict[str, Any], split: str, index: int, with_tools: bool) -> dict[str, Any]:
    """One parquet row from one GSM8K example."""
    for key in ("question", "answer"):
        if key not in example:
            raise ValueError(f"GSM8K example {index} has no {key!r} field (keys: {sorted(example)})")
    question, answer = example["question"], example["answer"]
    ground_truth = gold_answer(answer)
    user = {"role": "user", "content": f"{question} {INSTRUCTION}"}
    extra_info: dict[str, Any] = {"split": split, "index": index, "question": question, "answer": answer}
    prompt = [user]
    if with_tools:
        prompt = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, user]
        extra_info["agent_name"] = TOOL_AGENT
        extra_info["tools_kwargs"] = {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def preprocess(input_path: Path, output_path: Path, split: str, with_tools: bool) -> int:
    """Convert a GSM8K .jsonl file to a parquet file of RL rows; returns the row count."""
    import datasets

    if not input_path.is_file():
        raise FileNotFoundError(f"--input {input_path} does not exist")
    rows = [build_row(ex, split, i, with_tools) for i, ex in enumerate(read_jsonl(input_path))]
    if not rows:
        raise ValueError(f"--input {input_path} holds no examples")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp))
    tmp.replace(output_path)
    return len(rows)
