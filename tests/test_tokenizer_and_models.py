"""The shipped tokenizer (special tokens, round trip, chat template, determinism) and tiny models."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megarl.assets import asset_path

sys.path.insert(0, str(REPO / "tools"))
from build_tokenizer import MARKERS, SPECIAL, build

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "check_answer",
            "description": "Check an answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": "check_answer", "arguments": {"answer": "5"}}},
            {"type": "function", "function": {"name": "check_answer", "arguments": '{"answer": "6"}'}},
        ],
    },
    {"role": "tool", "content": "correct"},
    {"role": "tool", "content": "wrong"},
    {"role": "assistant", "content": "#### 5"},
]
RENDERED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "Functions you can call are described in <tools></tools>, one JSON schema per line:\n<tools>\n"
    '{"type": "function", "function": {"name": "check_answer", "description": "Check an answer.", "parameters": '
    '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}\n</tools>\n\n'
    "To call one, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n"
    '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "5"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "6"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\ncorrect\n</tool_response>\n<tool_response>\nwrong\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n#### 5<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(asset_path("tokenizer"))


def test_special_tokens_have_fixed_single_ids(tok) -> None:  # type: ignore[no-untyped-def]
    assert len(tok) == 4096
    for expected_id, token in enumerate(SPECIAL + MARKERS):
        assert tok.encode(token, add_special_tokens=False) == [expected_id]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 2, None)


def test_decode_round_trip(tok) -> None:  # type: ignore[no-untyped-def]
    for text in [
        "",
        "a\n\n b\t",
        "12,345.67 - 8 = ?",
        "naïve café — 日本語 🙂",
        "<|im_start|>x<tool_call>{}</tool_call>",
    ]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("2024", add_special_tokens=False) == [tok.convert_tokens_to_ids(d) for d in "2024"]


def test_skip_special_tokens_keeps_tool_markers(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_turns_and_tools(tok) -> None:  # type: ignore[no-untyped-def]
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == RENDERED
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_is_prefix_stable(tok) -> None:  # type: ignore[no-untyped-def]
    """messages[:k] + generation prompt + the assistant's own text + <|im_end|>\n == messages[:k+1]."""
    tool_call_turn = RENDERED.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    cases = [(CONVERSATION, 2, tool_call_turn), (CONVERSATION, 5, "#### 5"), (chat, 1, "b"), (chat, 3, "d")]
    for messages, k, reply in cases:
        head = tok.apply_chat_template(messages[:k], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages[: k + 1], tools=TOOLS, tokenize=False)
        assert head + reply + "<|im_end|>\n" == full, k


def test_builder_is_deterministic(tmp_path: Path) -> None:
    build(REPO / "data" / "gsm8k", tmp_path, 4096)
    assert (tmp_path / "tokenizer.json").read_bytes() == (asset_path("tokenizer") / "tokenizer.json").read_bytes()
    assert (tmp_path / "chat_template.jinja").read_text() == (
        asset_path("tokenizer") / "chat_template.jinja"
    ).read_text()


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_tiny_models_build_and_run(name: str, tok) -> None:  # type: ignore[no-untyped-def]
    config = AutoConfig.from_pretrained(asset_path(f"models/{name}"))
    assert config.vocab_size == len(tok) and config.eos_token_id == tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False)
    input_ids = torch.tensor([tok.encode(ids, add_special_tokens=False)])
    logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], 4096) and torch.isfinite(logits).all()
    expert_params = [n for n, _ in model.named_parameters() if ".experts." in n]
    if name == "tiny_moe":
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)
        assert expert_params
    else:
        assert not expert_params
