"""The shipped tokenizer (token ids, round trip, chat template, reproducible build) and the tiny model configs."""

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from megarl.assets import asset_path

REPO_ROOT = Path(__file__).resolve().parents[3]
VOCAB_SIZE = 4096
TOKEN_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<tool_call>": 3,
    "</tool_call>": 4,
    "<tool_response>": 5,
    "</tool_response>": 6,
    "<think>": 7,
    "</think>": 8,
}
SPECIAL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "check_answer",
            "description": "Check an answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
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
    "You can call the functions whose JSON schemas are listed one per line in <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "check_answer", "description": "Check an answer.", "parameters": '
    '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}\n</tools>\n\n'
    "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n"
    '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "5"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "6"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\ncorrect\n</tool_response>\n<tool_response>\nwrong\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n#### 5<|im_end|>\n"
)


def load_builder() -> ModuleType:
    """tools/build_tokenizer.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_tokenizer", REPO_ROOT / "tools" / "build_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(asset_path("tokenizer"))


def render(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str)
    return text


def test_vocab_and_token_ids(tok: PreTrainedTokenizerBase) -> None:
    assert len(tok) == VOCAB_SIZE
    for token, expected_id in TOKEN_IDS.items():
        assert tok.encode(token, add_special_tokens=False) == [expected_id], token
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 2, None)
    assert set(tok.all_special_tokens) == SPECIAL
    assert (tok.model_max_length, tok.padding_side) == (2048, "right")
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "a\n\n b\t\r\n  ",
        "  leading and trailing spaces  ",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
        "-12,345.67e-8 + 0.5 = ?",
        "naïve café — 日本語 🙂 👩‍👩‍👧 ｆｕｌｌ",
        "e\u0301 and \u00e9 stay distinct",
        '<|im_start|>user\n{"a": [1, 2]}<|im_end|><tool_call>\n{}\n</tool_call><think></think><|endoftext|>',
    ],
)
def test_decode_round_trip(tok: PreTrainedTokenizerBase, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_digits_are_single_tokens(tok: PreTrainedTokenizerBase) -> None:
    assert tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False)) == ["2", "0", "2", "4"]


def test_skip_special_tokens_keeps_tool_markers(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_tool_conversation(tok: PreTrainedTokenizerBase) -> None:
    assert render(tok, CONVERSATION) == RENDERED
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False)
    assert tok.decode(ids) == RENDERED


def test_chat_template_default_system_and_generation_prompt(tok: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert tok.apply_chat_template([*messages, call], tokenize=False).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_chat_template_is_prefix_stable(tok: PreTrainedTokenizerBase) -> None:
    """messages[:k] + generation prompt + the assistant's reply + "<|im_end|>\\n" == messages[:k+1], as text and ids."""
    tool_call_reply = RENDERED.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    chat: list[dict[str, Any]] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\n"}]
    chat += [{"role": "user", "content": "c"}, {"role": "assistant", "content": ""}]
    cases = [(CONVERSATION, 2, tool_call_reply), (CONVERSATION, 5, "#### 5"), (chat, 1, "b\n"), (chat, 3, "")]
    for messages, k, reply in cases:
        prompt = render(tok, messages[:k], add_generation_prompt=True)
        response = reply + "<|im_end|>\n"
        full = render(tok, messages[: k + 1])
        assert prompt + response == full, k
        prompt_ids, response_ids = tok.encode(prompt), tok.encode(response)
        assert prompt_ids + response_ids == tok.encode(full), k
    # Cut after any complete turn (not inside a group of tool responses), the rendering is a prefix of the full one.
    for k in [1, 2, 3, 5, 6]:
        assert RENDERED.startswith(render(tok, CONVERSATION[:k])), k


def test_builder_reproduces_shipped_files(tmp_path: Path) -> None:
    load_builder().main(["--out", str(tmp_path)])
    shipped = asset_path("tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for path in tmp_path.iterdir():
        assert path.read_bytes() == (shipped / path.name).read_bytes(), path.name
    assert (shipped / "tokenizer.json").stat().st_size < 400_000


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "tiny_qwen2_moe", "tiny_glm4_moe"])
def test_tiny_model_builds_and_runs(tok: PreTrainedTokenizerBase, name: str) -> None:
    config = AutoConfig.from_pretrained(asset_path(f"models/{name}"))
    assert len(tok) == config.vocab_size == VOCAB_SIZE
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (2, 0, None)
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (64, 2, 2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    input_ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 17 * 3?"}], tools=TOOLS, add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [1, s, v]
    assert logits.shape == (1, input_ids.shape[1], VOCAB_SIZE)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    params = dict(model.named_parameters())
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        if name != "tiny_dense" and not (name == "tiny_glm4_moe" and layer == 0):  # GLM's first layer is dense
            assert params[prefix + "gate.weight"].shape == (4, 64)
            assert params[prefix + "experts.gate_up_proj"].shape == (4, 2 * 32, 64)
            assert params[prefix + "experts.down_proj"].shape == (4, 64, 32)
        else:
            assert params[prefix + "gate_proj.weight"].shape == (128, 64)
            assert not any(n.startswith(prefix) and ".experts." in n for n in params)
