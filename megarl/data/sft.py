"""Chat conversations from parquet → token rows in the RL batch layout, with the loss on the assistant's tokens.

A row holds `messages` (OpenAI chat format: system / user / assistant / tool; assistant messages may carry
`tool_calls`, tool messages `tool_call_id` and `name`) and optionally `tools` (OpenAI function schemas: a list, or
the JSON string of one, as `megarl-preprocess sft` writes it). `tokenize_conversation` renders it with the chat
template and cuts it where the first assistant turn begins:

    prompt_ids     the turns before the first assistant message and its generation prompt (`<|im_start|>assistant\\n`)
    response_ids   the rest, to the end of the last assistant turn and the template's tail after its EOS (`\\n`)
    response_mask  1 on each assistant turn: its content, its tool calls as the template renders them and the EOS
                   that closes it (the model learns to stop); 0 on system / user / tool turns, the assistant
                   headers and the tails after each EOS

Assistant turn i is found by rendering prefixes: render(messages[:i], generation prompt) must be a prefix of
render(messages[:i+1]), and that of the whole conversation; the difference is the turn, which ends with the
template's EOS and tail (`ChatTokens.turn_close`). A template that renders earlier turns differently once later
ones follow (one that drops past reasoning, say) is refused, naming the row.

Choices: messages after the last assistant turn carry no loss and are left out; a conversation that opens with an
assistant message is refused (the trainer needs a prompt: start it with a system or user turn); rows without an
assistant turn are dropped and counted (`num_without_assistant`), and a dataset of only such rows is refused; rows
over `max_length` tokens are dropped and counted (`num_filtered`). Null fields are dropped before rendering
(parquet fills the keys a struct lacks in one message but has in another with nulls). A message's content may be a
list of parts (`{"type": "text", "text": ...}`, `{"type": "image"}`); rows with an `images` column are read by the
model's image processor (megarl/data/sft_images.py).

`megarl.data.sft_jsonl.preprocess_jsonl` writes such rows from JSONL (`megarl-preprocess sft`).

`collate_sft` stacks rows into the tensors of `megarl.agents.postprocess.to_batch` (the layout the actor's
Megatron engine reads), as wide as the batch's longest prompt and longest response.
"""

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megarl.batch import MULTI_MODAL_COLUMN, Batch
from megarl.data.checks import DataError
from megarl.data.images import ImageError
from megarl.data.sft_images import IMAGES, SFTImages, collate_images

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
FIX = "re-run megarl-preprocess sft (megarl/data/sft.py shows the row layout)"


class ChatTemplate(Protocol):
    """What SFT reads of `megarl.agents.chat_tokens.ChatTokens`; the caller builds it (data sits below agents)."""

    tokenizer: Any
    template_kwargs: dict[str, Any]
    turn_close: list[int]
    """EOS and the tail the template puts after it (`<|im_end|>\\n`)."""

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any = None) -> list[int]: ...


@dataclass(kw_only=True, slots=True)
class SFTTokens:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 on the assistant turns' tokens (content, tool calls, closing EOS), 0 elsewhere; aligned with response_ids."""


def tokenize_conversation(
    chat: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> SFTTokens:
    """One conversation (with at least one assistant message, not the first) → prompt, response and loss mask."""
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant:
        raise DataError("the conversation has no assistant turn: SFT trains on assistant tokens only")
    if assistant[0] == 0:
        raise DataError(
            "the conversation opens with an assistant message; SFT needs a prompt before the first assistant turn: "
            "start it with a system or user message"
        )
    full = chat.encode(messages[: assistant[-1] + 1], add_generation_prompt=False, tools=tools)
    mask = [0] * len(full)
    spans = [_assistant_span(chat, messages, i, tools, full) for i in assistant]
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    first = spans[0][0]
    return SFTTokens(prompt_ids=full[:first], response_ids=full[first:], response_mask=mask[first:])


def _assistant_span(
    chat: ChatTemplate, messages: list[dict[str, Any]], i: int, tools: list[dict[str, Any]] | None, full: list[int]
) -> tuple[int, int]:
    """[start, end) in `full` of assistant message i's loss tokens: after its header, up to its EOS included."""
    head = chat.encode(messages[:i], add_generation_prompt=True, tools=tools)
    turn = chat.encode(messages[: i + 1], add_generation_prompt=False, tools=tools)
    if turn[: len(head)] != head or full[: len(turn)] != turn:
        raise DataError(
            f"message {i} (assistant): the chat template is not prefix-stable (the conversation rendered up to this "
            "turn is not how the longer conversation begins); SFT masks turns by rendering prefixes: use a template "
            "whose turns render independently of later ones (megarl's shipped one does)"
        )
    close = chat.turn_close
    if len(turn) - len(head) < len(close) or turn[len(turn) - len(close) :] != close:
        raise DataError(
            f"message {i} (assistant): the chat template does not close the turn with EOS and tail {close}; "
            "SFT needs the EOS that ends each assistant turn to train the model to stop"
        )
    return len(head), len(turn) - len(close) + 1


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a list of chat messages SFT can render; None when it is."""
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.80}"
    for i, message in enumerate(messages):
        problem = _message_problem(message)
        if problem is not None:
            return f"message {i} {problem}"
    return None


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return f"must be a dict with a 'role' in {ROLES}, got {message!r:.80}"
    calls = message.get("tool_calls")
    if calls is not None and not (
        message["role"] == "assistant" and isinstance(calls, list) and all(_is_call(call) for call in calls)
    ):
        return (
            "has tool_calls that are not a list of {'function': {'name': ..., 'arguments': ...}} on an assistant "
            f"message: {message!r:.80}"
        )
    content = message.get("content")
    if not (isinstance(content, str) or _is_parts(content)) and not (calls and content is None):
        return f"needs a string 'content' or a list of parts (null only beside tool_calls), got {message!r:.80}"
    return None


def _is_parts(content: Any) -> bool:
    """Content parts: `{"type": "text", "text": str}` or `{"type": "image"}` each."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("text", "image") for p in content
    )


def _is_call(call: Any) -> bool:
    """An OpenAI tool call: `{"function": {"name": str, "arguments": object or JSON string}}`."""
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """The tool schemas of a row from a list or its JSON string; None for none. Raises DataError otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DataError(f"tools is not valid JSON ({err.msg} at char {err.pos})") from err
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise DataError(f"tools must be a list of OpenAI function schemas (or its JSON string), got {value!r:.80}")
    return without_nulls(value) or None


def without_nulls(value: Any) -> Any:
    """`value` with every None-valued dict key dropped, at any depth."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


class SFTDataset:
    """Map-style dataset of tokenized chat conversations read from parquet through `datasets`."""

    def __init__(
        self,
        files: Sequence[str],
        chat: ChatTemplate,
        *,
        max_length: int,
        messages_key: str = "messages",
        tools_key: str = "tools",
        max_samples: int | None = None,
    ) -> None:
        self.files = list(files)
        self.chat = chat
        self.max_length = max_length
        self.messages_key = messages_key
        self.tools_key = tools_key
        table = _read_parquet(self.files, messages_key)
        self.images = SFTImages.of(chat.tokenizer, table.column_names, self.files)
        if max_samples is not None:
            table = table.select(range(min(max_samples, len(table))))
        num_rows = len(table)
        table = table.map(
            self._encode_batch,
            batched=True,
            with_indices=True,
            remove_columns=[column for column in table.column_names if column != IMAGES],
            new_fingerprint=self._fingerprint(table),
            desc="tokenize conversations",
        )
        table = table.filter(lambda n: n > 0, input_columns="num_tokens")
        self.num_without_assistant = num_rows - len(table)
        if not len(table):
            raise DataError(
                f"{self.files} has no assistant turns: SFT trains on assistant tokens only (column "
                f"{messages_key!r} of {num_rows} rows; sft.messages_key names it)"
            )
        self.table = self._drop_overlong(table)
        self.num_filtered = len(table) - len(self.table)
        logger.info(
            "SFT data: %d conversations (%d without an assistant turn, %d over %d tokens dropped)",
            len(self.table),
            self.num_without_assistant,
            self.num_filtered,
            max_length,
        )

    def _fingerprint(self, table: Any) -> str:
        """The cache key of the tokenized table: the data, the tokenizer, its template and the keys."""
        tokenizer = self.chat.tokenizer
        key = [
            table._fingerprint,
            tokenizer.name_or_path,
            len(tokenizer),
            tokenizer.chat_template,
            self.chat.template_kwargs,
            self.messages_key,
            self.tools_key,
            self.images.fingerprint() if self.images else None,
        ]
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _encode_batch(self, rows: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        tools_column = rows.get(self.tools_key) or [None] * len(indices)
        images = rows.get(IMAGES) or [None] * len(indices)
        out: dict[str, list[Any]] = {"prompt_ids": [], "response_ids": [], "response_mask": [], "num_tokens": []}
        for messages, tools, row_images, index in zip(
            rows[self.messages_key], tools_column, images, indices, strict=True
        ):
            tokens = self._with_images(self._encode_row(messages, tools, index), row_images, index)
            out["prompt_ids"].append(tokens.prompt_ids)
            out["response_ids"].append(tokens.response_ids)
            out["response_mask"].append(tokens.response_mask)
            out["num_tokens"].append(len(tokens.prompt_ids) + len(tokens.response_ids))
        return out

    def _encode_row(self, messages: Any, tools: Any, index: int) -> SFTTokens:
        """The row's tokens; no tokens (dropped) without an assistant turn; DataError naming the row when bad."""
        problem = messages_problem(messages)
        if problem is not None:
            raise DataError(f"{_where(self.files, index)} column {self.messages_key!r}: {problem}; {FIX}")
        if not any(message["role"] == "assistant" for message in messages):
            return SFTTokens(prompt_ids=[], response_ids=[], response_mask=[])
        try:
            return tokenize_conversation(self.chat, without_nulls(messages), parse_tools(tools))
        except DataError as err:
            raise DataError(f"{_where(self.files, index)}: {err}") from err

    def _with_images(self, tokens: SFTTokens, images: list[Any] | None, index: int) -> SFTTokens:
        """`tokens` with the row's image placeholders expanded (an image dataset's rows with an assistant turn)."""
        if self.images is None or not tokens.prompt_ids:
            return tokens
        try:
            expanded = self.images.expand(tokens.prompt_ids, tokens.response_ids, tokens.response_mask, images or [])
        except ImageError as err:
            raise DataError(f"{_where(self.files, index)} column {IMAGES!r}: {err}") from err
        return SFTTokens(prompt_ids=expanded[0], response_ids=expanded[1], response_mask=expanded[2])

    def _drop_overlong(self, table: Any) -> Any:
        """`table` without its conversations over max_length tokens; a DataError when that leaves none."""
        kept = table.filter(lambda n: n <= self.max_length, input_columns="num_tokens")
        if not len(kept):
            raise DataError(
                f"{self.files}: all {len(table)} conversations are over sft.max_length={self.max_length} tokens "
                f"(the shortest has {min(table['num_tokens'])}); raise sft.max_length"
            )
        return kept

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The row's tokens; with an image dataset also its `multi_modal_inputs` (None without images)."""
        row = self.table[index]
        tokens = {key: row[key] for key in ("prompt_ids", "response_ids", "response_mask")}
        if self.images is None:
            return tokens
        return tokens | {MULTI_MODAL_COLUMN: self.images.inputs(list(row[IMAGES] or []))}


def _read_parquet(files: list[str], messages_key: str) -> Any:
    """The rows of `files` as one `datasets` table; DataError when unreadable or without the messages column."""
    import datasets

    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"SFT data files not found: {missing}; run megarl-preprocess sft or fix the paths")
    try:
        table = datasets.load_dataset("parquet", data_files=files, split="train")
    except (pa.ArrowException, datasets.exceptions.DatasetGenerationError) as err:
        cause = " ".join(str(err.__cause__ or err).split())
        raise DataError(
            f"cannot read the parquet files {files} ({cause}); each must be parquet, all with the same columns; {FIX}"
        ) from err
    if messages_key not in table.column_names:
        raise DataError(
            f"{files} has no column {messages_key!r} of chat messages (columns: {table.column_names}); set "
            f"sft.messages_key to the column that holds them, or {FIX}"
        )
    return table


def _where(files: list[str], index: int) -> str:
    """`file row r` of the table's row `index` (the files are read in order)."""
    for path in files:
        num_rows = pq.ParquetFile(path).metadata.num_rows
        if index < num_rows:
            return f"{path} row {index}"
        index -= num_rows
    raise AssertionError("row index past the files' rows")


def collate_sft(rows: list[dict[str, Any]], pad_token_id: int) -> Batch:
    """Stack `SFTDataset` rows into the RL batch layout (P, R = the batch's longest prompt and response):

    prompts [B, P] left-padded, responses [B, R] right-padded, input_ids [B, P+R], attention_mask [B, P+R]
    (1 on real tokens), position_ids [B, P+R] (0.. over real tokens), response_mask [B, R] (1 = loss token);
    rows of an image dataset add the non-tensor `multi_modal_inputs` (`sft_images.collate_images`).
    """
    num_prompt = max(len(row["prompt_ids"]) for row in rows)
    num_response = max(len(row["response_ids"]) for row in rows)
    prompts = torch.full((len(rows), num_prompt), pad_token_id, dtype=torch.long)
    responses = torch.full((len(rows), num_response), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros((len(rows), num_prompt), dtype=torch.long)
    response_attention = torch.zeros((len(rows), num_response), dtype=torch.long)
    response_mask = torch.zeros((len(rows), num_response), dtype=torch.long)
    for i, row in enumerate(rows):
        p, r = len(row["prompt_ids"]), len(row["response_ids"])
        prompts[i, num_prompt - p :] = torch.tensor(row["prompt_ids"], dtype=torch.long)
        prompt_attention[i, num_prompt - p :] = 1
        responses[i, :r] = torch.tensor(row["response_ids"], dtype=torch.long)
        response_attention[i, :r] = 1
        response_mask[i, :r] = torch.tensor(row["response_mask"], dtype=torch.long)
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    return Batch.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
        },
        non_tensors=collate_images(rows),
    )
