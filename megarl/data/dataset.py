"""`RLDataset`: parquet prompt rows → chat-templated prompt token ids, plus what rollout and reward need.

Rows follow the layout `megarl-preprocess` writes (see `megarl.data.gsm8k`). Each row's messages
(`prompt_key`) are rendered once with the tokenizer's chat template (`add_generation_prompt=True`,
plus the row's tool schemas when it names tools) and tokenized; prompts over `max_prompt_length`
are dropped (`filter_overlong_prompts`) or cut (`truncation`: left keeps the end, right keeps the
start, middle keeps both ends) or rejected (`error`). Bad data raises `DataError` naming the file and row
(`megarl.data.checks`, which `validate` runs on the first rows of each file before anything starts).
"""

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from megarl.batch import MULTI_MODAL_COLUMN, Batch
from megarl.data.checks import FIX, DataError, extra_info_problem, prompt_problem
from megarl.data.images import IMAGE_TOKEN, ImageError, ImageProcessor, expand_image_tokens

IMAGES = "images"
"""The column of a vision-language row's encoded images, one per image part of its prompt, in order."""

logger = logging.getLogger(__name__)


def load_tool_schemas(path: str) -> dict[str, dict[str, Any]]:
    """OpenAI function schemas by tool name from a tool config YAML (`tools: [{class_name, tool_schema}]`)."""
    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("tools"), list):
        raise ValueError(f"{path}: expected a mapping with a `tools:` list")
    schemas = {}
    for i, entry in enumerate(spec["tools"]):
        try:
            name = entry["tool_schema"]["function"]["name"]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: tools[{i}] needs tool_schema.function.name") from err
        schemas[name] = entry["tool_schema"]
    return schemas


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut `ids` to `max_length` tokens: left keeps the end, right the start, middle both ends."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"data.truncation={mode!r} is unknown; choose error, left, right or middle")


class RLDataset:
    """Map-style dataset of RL prompts read from parquet through `datasets`."""

    def __init__(
        self,
        files: Sequence[str],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        tool_schemas: dict[str, dict[str, Any]] | None = None,
        default_agent_name: str = "single_turn",
        max_samples: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import datasets

        missing = [f for f in files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"data files not found: {missing}; run megarl-preprocess or fix data.*_files")
        try:
            table = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
        except (pa.ArrowException, datasets.exceptions.DatasetGenerationError) as err:
            cause = " ".join(str(err.__cause__ or err).split())
            raise DataError(
                f"cannot read the parquet files {list(files)} ({cause}); each must be parquet, all with the same "
                f"columns and types; {FIX}"
            ) from err
        self.files = list(files)
        if prompt_key not in table.column_names:
            raise DataError(f"data.prompt_key={prompt_key!r} is not a column of {self.files} ({table.column_names})")
        if max_samples is not None:
            table = table.select(range(min(max_samples, len(table))))
        self.tokenizer = tokenizer
        self.images = self._image_processor(table.column_names)
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.tool_schemas = tool_schemas
        self.default_agent_name = default_agent_name
        self.chat_template_kwargs = chat_template_kwargs or {}
        num_rows = len(table)
        fingerprint = hashlib.sha256(
            json.dumps(
                [
                    table._fingerprint,
                    tokenizer.name_or_path,
                    len(tokenizer),
                    tokenizer.chat_template,
                    prompt_key,
                    max_prompt_length,
                    truncation,
                    filter_overlong_prompts,
                    tool_schemas,
                    self.chat_template_kwargs,
                    self.images.processor.to_json_string() if self.images else None,
                ],
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:16]
        table = table.map(
            self._encode_batch,
            batched=True,
            with_indices=True,
            new_fingerprint=fingerprint,
            desc="tokenize prompts",
            fn_kwargs={"filter_overlong": filter_overlong_prompts},
        )
        if filter_overlong_prompts:
            table = self._drop_overlong(table)
        self.table = table
        self.num_filtered = num_rows - len(table)
        if self.num_filtered:
            logger.info("dropped %d of %d prompts over %d tokens", self.num_filtered, num_rows, max_prompt_length)

    def _encode_batch(self, rows: dict[str, list[Any]], indices: list[int], filter_overlong: bool) -> dict[str, Any]:
        extras = rows.get("extra_info") or [None] * len(indices)
        tool_columns = rows.get("tools_kwargs") or [None] * len(indices)
        images = rows.get(IMAGES) or [None] * len(indices)
        prompt_ids, lengths = [], []
        for messages, extra, tool_column, row_images, index in zip(
            rows[self.prompt_key], extras, tool_columns, images, indices, strict=True
        ):
            for column, problem in (
                (self.prompt_key, prompt_problem(messages)),
                ("extra_info", extra_info_problem(extra)),
            ):
                if problem is not None:
                    raise DataError(f"{self._where(index)} column {column!r}: {problem}")
            tools = self._tools_for(_tools_kwargs(tool_column, extra or {}), index)
            ids = self._render(messages, tools)
            if self.images is not None:
                ids = self._with_images(ids, row_images, index)
            lengths.append(len(ids))
            if len(ids) > self.max_prompt_length and not filter_overlong:
                if row_images:
                    raise DataError(
                        f"prompt of {self._where(index)} has {len(ids)} tokens (its images' included) > "
                        f"data.max_prompt_length={self.max_prompt_length}; a prompt with images is not cut: set "
                        "data.filter_overlong_prompts=true or raise data.max_prompt_length"
                    )
                if self.truncation == "error":
                    raise DataError(
                        f"prompt of {self._where(index)} has {len(ids)} tokens > data.max_prompt_length="
                        f"{self.max_prompt_length}; raise it, set data.filter_overlong_prompts=true, or set "
                        "data.truncation to left, right or middle"
                    )
                ids = truncate(ids, self.max_prompt_length, self.truncation)
            prompt_ids.append(ids)
        return {"prompt_ids": prompt_ids, "num_prompt_tokens": lengths}

    def _image_processor(self, columns: list[str]) -> ImageProcessor | None:
        """The model's image processor when the rows have an `images` column; None without one."""
        if IMAGES not in columns:
            return None
        path = self.tokenizer.name_or_path
        found = ImageProcessor.of(self.tokenizer, path)
        if found is None:
            raise DataError(
                f"{self.files} have an `{IMAGES}` column but the tokenizer at {path!r} has no {IMAGE_TOKEN} token or "
                "no preprocessor_config.json; set model.tokenizer_path to the vision-language model's directory"
            )
        return found

    def _with_images(self, ids: list[int], images: list[Any] | None, index: int) -> list[int]:
        """`ids` with the row's image placeholders expanded (one token per merged patch)."""
        try:
            assert self.images is not None, "rows are expanded only with an image processor"
            counts = self.images.token_counts(list(images or []))
            return expand_image_tokens(ids, counts, self.images.image_token_id)
        except ImageError as err:
            raise DataError(f"{self._where(index)} column {IMAGES!r}: {err}") from err

    def _drop_overlong(self, table: Any) -> Any:
        """`table` without its prompts over max_prompt_length; a DataError when that leaves none."""
        kept = table.filter(lambda n: n <= self.max_prompt_length, input_columns="num_prompt_tokens")
        if len(table) and not len(kept):
            raise DataError(
                f"{self.files}: all {len(table)} prompts are over data.max_prompt_length={self.max_prompt_length} "
                f"tokens (the shortest has {min(table['num_prompt_tokens'])} after the chat template); raise "
                "data.max_prompt_length, or set data.filter_overlong_prompts=false and data.truncation=left, right "
                "or middle"
            )
        return kept

    def _where(self, index: int) -> str:
        """`file row r` of the table's row `index` (the files are read in order)."""
        for path in self.files:
            num_rows = pq.ParquetFile(path).metadata.num_rows
            if index < num_rows:
                return f"{path} row {index}"
            index -= num_rows
        raise AssertionError("row index past the files' rows")

    def _tools_for(self, tools_kwargs: dict[str, Any], index: int) -> list[Any] | None:
        """The schemas of the tools a row names, in its order; None when it names none."""
        if not tools_kwargs:
            return None
        if self.tool_schemas is None:
            raise DataError(
                f"{self._where(index)} names tools {sorted(tools_kwargs)} but no tool config is given; "
                "set rollout.multi_turn.tool_config_path (e.g. +experiment=gsm8k_tools)"
            )
        unknown = sorted(set(tools_kwargs) - set(self.tool_schemas))
        if unknown:
            raise DataError(
                f"{self._where(index)} names tools {unknown} that the tool config does not define "
                f"(it has {sorted(self.tool_schemas)})"
            )
        return [self.tool_schemas[name] for name in tools_kwargs]

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.table[index]
        extra = row.get("extra_info") or {}
        return {
            "prompt_ids": row["prompt_ids"],
            "raw_prompt": row[self.prompt_key],
            "data_source": row.get("data_source"),
            "reward_model": row.get("reward_model") or {},
            "extra_info": extra,
            "tools_kwargs": _tools_kwargs(row.get("tools_kwargs"), extra),
            "agent_name": row.get("agent_name") or extra.get("agent_name") or self.default_agent_name,
            "index": extra.get("index", index),
            **self._row_images(row),
        }

    def _row_images(self, row: dict[str, Any]) -> dict[str, Any]:
        """A vision-language row's encoded `images` and their `multi_modal_inputs` (None without images); nothing
        for a text dataset."""
        if self.images is None:
            return {}
        raw = list(row.get(IMAGES) or [])
        if not raw:
            return {IMAGES: [], MULTI_MODAL_COLUMN: None}
        inputs = self.images.inputs(raw)
        patches = {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.grid_thw}
        return {IMAGES: raw, MULTI_MODAL_COLUMN: patches}


def _tools_kwargs(column: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Per-tool create/execute kwargs of a row: a top-level column wins over extra_info's; None entries dropped."""
    found = column if column is not None else extra.get("tools_kwargs")
    return {name: kwargs for name, kwargs in (found or {}).items() if kwargs is not None}


def collate_prompts(rows: list[dict[str, Any]], pad_token_id: int, max_prompt_length: int) -> Batch:
    """Stack dataset rows into a `Batch`: left-padded `input_ids [b, max_prompt_length]`, its
    `attention_mask` and `position_ids`, and every other field as a per-row non-tensor
    (`raw_prompt_ids` keeps the unpadded ids for token-in/token-out rollout)."""
    input_ids = torch.full((len(rows), max_prompt_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), max_prompt_length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids = row["prompt_ids"]
        assert len(ids) <= max_prompt_length, "RLDataset filters or truncates prompts to max_prompt_length"
        input_ids[i, max_prompt_length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, max_prompt_length - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    non_tensors = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt_ids"}
    non_tensors["raw_prompt_ids"] = [row["prompt_ids"] for row in rows]
    return Batch.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors=non_tensors,
    )
