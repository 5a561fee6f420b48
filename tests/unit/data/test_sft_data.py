"""The chat SFT data: assistant-only loss masks on the shipped tokenizer (a multi-turn tool-calling conversation),
SFTDataset's drops and errors, `collate_sft`'s layout, and `megarl-preprocess sft` / `largest-sft` read back."""

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from megarl.agents.chat_tokens import ChatTokens
from megarl.assets import asset_path
from megarl.cli.preprocess import main as preprocess_main
from megarl.data import SFTDataset, StatefulDataLoader, collate_sft, tokenize_conversation
from megarl.data.checks import DataError
from megarl.data.largest import format_examples

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
CONVERSATION = [
    {"role": "system", "content": "You are a calculator. Use the add tool."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "Let me add them.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 5 + 4?"},
    {"role": "assistant", "content": "5 + 4 = 9."},
]
ASSISTANT_TURNS = [  # each assistant message's content, its tool call as the shipped template writes it, its EOS
    'Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    "2 + 3 = 5.<|im_end|>",
    "5 + 4 = 9.<|im_end|>",
]
OTHER_TURNS = [  # what lies between and after them in the response: the tool and user turns, headers, tails
    "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "\n<|im_start|>user\nAnd 5 + 4?<|im_end|>\n<|im_start|>assistant\n",
    "\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(asset_path("tokenizer"))


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatTokens:
    return ChatTokens(tokenizer)


def runs(ids: list[int], mask: list[int], value: int) -> list[list[int]]:
    """The maximal runs of `ids` whose mask is `value`, in order."""
    found: list[list[int]] = []
    for i, (token, bit) in enumerate(zip(ids, mask, strict=True)):
        if bit != value:
            continue
        if i and mask[i - 1] == value:
            found[-1].append(token)
        else:
            found.append([token])
    return found


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_tool_conversation_trains_on_assistant_turns_only(tokenizer: Any, chat: ChatTokens) -> None:
    tokens = tokenize_conversation(chat, CONVERSATION, TOOLS)
    prompt = tokenizer.decode(tokens.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou are a calculator. Use the add tool.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids, mask = tokens.response_ids, tokens.response_mask
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    assert [tokenizer.decode(span) for span in runs(ids, mask, 1)] == ASSISTANT_TURNS
    assert [tokenizer.decode(gap) for gap in runs(ids, mask, 0)] == OTHER_TURNS
    assert sum(mask) == sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in ASSISTANT_TURNS)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert tokenizer.decode(tokens.prompt_ids + ids) == rendered


def test_conversation_errors(tokenizer: Any, chat: ChatTokens) -> None:
    with pytest.raises(DataError, match="opens with an assistant message"):
        tokenize_conversation(chat, CONVERSATION[2:])
    with pytest.raises(DataError, match="no assistant turn"):
        tokenize_conversation(chat, CONVERSATION[:2])
    unstable = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    unstable.chat_template = (  # earlier assistant turns shortened once a later turn follows
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content if loop.last or m.role != "
        "'assistant' else '...') + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    with pytest.raises(DataError, match="message 1 .assistant.: the chat template is not prefix-stable"):
        tokenize_conversation(ChatTokens(unstable), [CONVERSATION[1], CONVERSATION[4], *CONVERSATION[5:]])


def test_preprocess_sft_round_trip(tmp_path: Path, chat: ChatTokens) -> None:
    """JSONL → parquet → SFTDataset gives the tokens of the JSONL's own messages (tool-call arguments as JSON strings,
    parquet's nulls dropped); a row without an assistant turn is dropped and counted; tools as a list column too."""
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    jsonl = tmp_path / "chats.jsonl"
    lines = [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": plain}, {"messages": CONVERSATION[:2]}]
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "chats.parquet"
    preprocess_main(["sft", "--input", str(jsonl), "--output", str(out)])
    dataset = SFTDataset([str(out)], chat, max_length=512)
    assert len(dataset) == 2 and dataset.num_without_assistant == 1 and dataset.num_filtered == 0
    for i, (messages, tools) in enumerate([(CONVERSATION, TOOLS), (plain, None)]):
        tokens = tokenize_conversation(chat, messages, tools)
        row = dataset[i]
        assert row == {
            "prompt_ids": tokens.prompt_ids,
            "response_ids": tokens.response_ids,
            "response_mask": tokens.response_mask,
        }
    as_list = write_parquet(tmp_path / "list.parquet", [{"messages": CONVERSATION, "tools": TOOLS}])
    assert SFTDataset([as_list], chat, max_length=512)[0] == dataset[0]
    batch = next(iter(StatefulDataLoader(dataset, 2, lambda rows: collate_sft(rows, 0), shuffle=False)))
    assert batch["response_mask"].sum() == sum(sum(dataset[i]["response_mask"]) for i in range(2))


def test_preprocess_sft_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(
        json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": [{"content": "x"}]}) + "\n"
    )
    with pytest.raises(SystemExit) as bad:
        preprocess_main(["sft", "--input", str(jsonl), "--output", str(tmp_path / "o.parquet")])
    assert bad.value.code == 2 and f"{jsonl}:2: message 0 must be a dict with a 'role'" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


def test_largest_sft_round_trip(tmp_path: Path, tokenizer: Any, chat: ChatTokens) -> None:
    """The warm-up's examples in order: question as prompt, answer + EOS as the only loss tokens, within the
    sft_largest experiment's sft.max_length=64."""
    out = tmp_path / "sft.parquet"
    preprocess_main(["largest-sft", "--output", str(out), "--num-rows", "48", "--seed", "0"])
    dataset = SFTDataset([str(out)], chat, max_length=64)
    assert len(dataset) == 48 and dataset.num_filtered == 0
    for i, (question, answer) in enumerate(format_examples(48, 0)):
        row = dataset[i]
        assert tokenizer.decode(row["prompt_ids"]).endswith(f"user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        assert [tokenizer.decode(span) for span in runs(row["response_ids"], row["response_mask"], 1)] == [
            f"{answer}<|im_end|>"
        ]


def test_dataset_errors(tmp_path: Path, chat: ChatTokens) -> None:
    user_only = write_parquet(tmp_path / "user.parquet", [{"messages": CONVERSATION[:2]}] * 3)
    with pytest.raises(DataError, match="has no assistant turns: SFT trains on assistant tokens only"):
        SFTDataset([user_only], chat, max_length=512)
    with pytest.raises(DataError, match=r"no column 'chat' .* sft.messages_key"):
        SFTDataset([user_only], chat, max_length=512, messages_key="chat")
    strings = write_parquet(tmp_path / "strings.parquet", [{"messages": "Hi there"}])
    with pytest.raises(DataError, match=r"strings.parquet row 0 column 'messages': messages must be a non-empty list"):
        SFTDataset([strings], chat, max_length=512)
    no_content = [{"messages": CONVERSATION[:3]}, {"messages": [{"role": "user"}, {"role": "assistant"}]}]
    with pytest.raises(DataError, match=r"content.parquet row 1 column 'messages': message 0 needs a string 'content'"):
        SFTDataset([write_parquet(tmp_path / "content.parquet", no_content)], chat, max_length=512)
    opening = write_parquet(tmp_path / "opening.parquet", [{"messages": CONVERSATION[2:]}])
    with pytest.raises(DataError, match="opening.parquet row 0: the conversation opens with an assistant message"):
        SFTDataset([opening], chat, max_length=512)


def test_dataset_drops_overlong_conversations(tmp_path: Path, chat: ChatTokens) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello " * n}]}
        for n in (1, 30, 2, 60)
    ]
    path = write_parquet(tmp_path / "lengths.parquet", rows)
    every = SFTDataset([path], chat, max_length=1000)
    rows = [every[i] for i in range(4)]
    lengths = [len(row["prompt_ids"]) + len(row["response_ids"]) for row in rows]
    assert lengths[0] < lengths[2] < lengths[1] < lengths[3]  # "Hello " ×1, ×2, ×30, ×60
    dataset = SFTDataset([path], chat, max_length=lengths[2])
    assert dataset.num_filtered == 2 and [dataset[0], dataset[1]] == [rows[0], rows[2]]
    with pytest.raises(DataError, match=r"all 4 conversations are over sft.max_length=5 .*raise sft.max_length"):
        SFTDataset([path], chat, max_length=5)


def test_collate_sft_layout() -> None:
    rows = [
        {"prompt_ids": [11, 12, 13], "response_ids": [21, 22], "response_mask": [1, 0]},
        {"prompt_ids": [14], "response_ids": [23, 24, 25, 26], "response_mask": [0, 1, 1, 0]},
    ]
    batch = collate_sft(rows, pad_token_id=0)
    expected = {
        "prompts": [[11, 12, 13], [0, 0, 14]],
        "responses": [[21, 22, 0, 0], [23, 24, 25, 26]],
        "input_ids": [[11, 12, 13, 21, 22, 0, 0], [0, 0, 14, 23, 24, 25, 26]],
        "attention_mask": [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]],
        "position_ids": [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]],
        "response_mask": [[1, 0, 0, 0], [0, 1, 1, 0]],
    }
    assert set(batch.tensors.keys()) == set(expected)
    for key, values in expected.items():
        assert torch.equal(batch[key], torch.tensor(values)), key
