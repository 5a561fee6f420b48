"""What a prompt parquet file must hold, checked by `validate` (`megarl.plan.gate`) before anything starts and by
`RLDataset` as it reads.

A file is readable parquet with the columns that `RLDataset` and the reward read (the layout `megarl-preprocess`
writes, see `megarl.data.gsm8k`):

- `data.prompt_key` (`prompt`): chat messages `[{'role': 'user', 'content': ...}, ...]`;
- `data_source`: picks the reward function (not needed when `reward.function` is set);
- `reward_model`: a mapping with the `ground_truth` the reward compares the response with;
- `extra_info` (optional): a mapping.

`validate` reads each file's footer and the first `SCAN_ROWS` rows of those columns, so a large file costs
little; `RLDataset` checks the prompt and extra_info of every row it renders, and that some prompt is left after
dropping the over-long ones (that needs the tokenizer).
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.config.data import DataConfig

SCAN_ROWS = 1024
FIX = "re-run megarl-preprocess (megarl/data/gsm8k.py shows the row layout)"


class DataError(ValueError):
    """Bad data met while building a dataset; the message names the file, and the row and column."""


def prompt_problem(messages: Any) -> str | None:
    """Why `messages` is not a list of chat messages; None when it is."""
    if isinstance(messages, str):
        return (
            "prompt must be chat messages [{'role': 'user', 'content': ...}], got a string; "
            "wrap it or re-run megarl-preprocess"
        )
    if not isinstance(messages, list) or not messages:
        return (
            f"prompt must be a non-empty list of chat messages [{{'role': ..., 'content': ...}}], got {messages!r:.80}"
        )
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return f"each prompt message needs a 'role' and a 'content', got {message!r:.80}"
    return None


def ground_truth_problem(reward_model: Any) -> str | None:
    """Why `reward_model` lacks the ground truth the reward compares with; None when it has one."""
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return None
    return (
        f"reward_model.ground_truth is missing (got {reward_model!r:.80}); the reward compares the response "
        "with it: write {'style': 'rule', 'ground_truth': ...}"
    )


def extra_info_problem(extra: Any) -> str | None:
    """Why `extra` is not a mapping (None, no extra info, is fine)."""
    if extra is None or isinstance(extra, dict):
        return None
    return f"extra_info must be a mapping (a parquet struct), got {type(extra).__name__} {extra!r:.60}"


def data_file_problems(data: DataConfig, reward_function: str | None) -> list[str]:
    """Every problem of `data.train_files` and `data.val_files`, one line each naming file, row and column."""
    problems = (
        [] if data.train_files else ["data.train_files is empty; give parquet files (megarl-preprocess writes them)"]
    )
    for field, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            problems.append(f"{field}={files!r} must be a parquet path or a list of them")
            continue
        problems += [p for path in files for p in file_problems(field, path, data.prompt_key, reward_function)]
    return problems


def file_problems(field: str, path: str, prompt_key: str, reward_function: str | None) -> list[str]:
    """The problems of one parquet file of `field`, from its footer and first `SCAN_ROWS` rows."""
    if not Path(path).is_file():
        return [f"{field}: {path} does not exist (run megarl-preprocess first, or fix the path)"]
    checks: dict[str, Callable[[Any], str | None]] = {
        prompt_key: prompt_problem,
        "reward_model": ground_truth_problem,
        "extra_info": extra_info_problem,
    }
    required = [prompt_key, "reward_model"] + (["data_source"] if reward_function is None else [])
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        columns = [c for c in checks if c in names]
        head = next(parquet.iter_batches(batch_size=SCAN_ROWS, columns=columns), None)
    except (pa.ArrowException, OSError) as err:
        return [f"{field}: {path} is not a readable parquet file ({err}); {FIX}"]
    missing = [c for c in required if c not in names]
    if missing:
        return [f"{field}: {path} has no column {c!r} (it has {names}); {_column_fix(c, prompt_key)}" for c in missing]
    if head is None:
        return [f"{field}: {path} has no rows; {FIX}"]
    return [
        problem
        for column in columns
        if (problem := _first_bad_row(f"{field}: {path}", column, head.column(column).to_pylist(), checks[column]))
    ]


def _column_fix(column: str, prompt_key: str) -> str:
    if column == prompt_key:
        return f"set data.prompt_key to the column of chat messages (it is {prompt_key!r}) or {FIX}"
    if column == "data_source":
        return f"{FIX}, or set reward.function=package.module:function to score every row"
    return FIX


def _first_bad_row(where: str, column: str, values: list[Any], check: Callable[[Any], str | None]) -> str | None:
    """The first row of `values` that `check` rejects, and how many more of them it rejects."""
    bad = [(row, problem) for row, value in enumerate(values) if (problem := check(value)) is not None]
    if not bad:
        return None
    row, problem = bad[0]
    more = f" (and {len(bad) - 1} more of the first {len(values)} rows)" if len(bad) > 1 else ""
    return f"{where} row {row} column {column!r}: {problem}{more}"
