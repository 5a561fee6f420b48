"""Build the tokenizer megarl ships (`megarl/assets/tokenizer/`) from the GSM8K text in the repo.

A byte-level BPE trained on every GSM8K question and answer plus a small fixed chat/tool-calling
corpus, so tool schemas and calls tokenize reasonably. Digits are split one per token (as in
Qwen2.5), so numbers have no arbitrary merges. The vocabulary holds, in this order and with these
ids, the ChatML control tokens (special: dropped by `decode(..., skip_special_tokens=True)`)
and the tool-call / reasoning markers (added but not special: the model writes them and decoding
keeps them). The chat template is `chat_template.jinja` beside this file.

Deterministic: the same data and arguments give a byte-identical tokenizer.json.

    python tools/build_tokenizer.py [--data-dir DIR] [--out DIR] [--vocab-size 4096]
"""

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "chat_template.jinja"
DATA_FILES = ("test.jsonl", "train.jsonl")
"""GSM8K files read from --data-dir, in this fixed (sorted) order."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""ChatML control tokens, ids 0-2: pad, turn start, turn end (eos)."""
MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Single-token markers the model writes itself, ids 3-8; not special, so decoding keeps them."""
MODEL_MAX_LENGTH = 2048
CHAT_CORPUS = """You are a helpful assistant.
You are a helpful assistant. Solve the problem step by step and give the final answer after ####.
Please reason step by step, then call the tool to check your answer before you reply.
You can call functions. Their signatures are listed as JSON objects, one per line.
{"type": "function", "function": {"name": "check_answer", "description": "Check a final answer to the problem.", \
"parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "The final numeric \
answer, e.g. \\"42\\"."}}, "required": ["answer"]}}}
{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", \
"parameters": {"type": "object", "properties": {"expression": {"type": "string"}, "precision": {"type": "number", \
"description": "Digits after the decimal point."}}, "required": ["expression"]}}}
{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {"type": \
"object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}, "strict": {"type": "boolean"}, \
"tags": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}}
{"name": "check_answer", "arguments": {"answer": "18"}}
{"name": "calculator", "arguments": {"expression": "(48 / 2) + 48", "precision": 2}}
{"name": "search", "arguments": {"query": "how many days are in a leap year", "top_k": 3, "strict": false}}
{"correct": true, "message": "The answer is correct."}
{"correct": false, "message": "The answer is incorrect. Try again."}
{"result": 72, "error": null}
To call a function, reply with its name and arguments as a JSON object.
The tool returned an error. Let me check my work and call the tool again.
system user assistant tool function name arguments parameters properties required type string number integer
boolean array object items enum description result error true false null
"""
CHAT_CORPUS_REPEATS = 50
"""The chat corpus is ~1% of the GSM8K text; repeating it lets its JSON and tool words earn merges."""


def read_corpus(data_dir: Path) -> Iterator[str]:
    """Training texts in a fixed order: each GSM8K question and answer, then the repeated chat corpus."""
    for name in DATA_FILES:
        with (data_dir / name).open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield row["question"]
                yield row["answer"]
    for _ in range(CHAT_CORPUS_REPEATS):
        yield CHAT_CORPUS


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` tokens; SPECIAL_TOKENS then MARKER_TOKENS take ids 0..8."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *MARKER_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    # The trainer registers every token it is given as special; the markers must be plain added tokens.
    spec = json.loads(bpe.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def build(data_dir: Path, out: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train the BPE, wrap it with the chat template, save it to `out` and return it."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(read_corpus(data_dir), vocab_size),
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>"],
        model_max_length=MODEL_MAX_LENGTH,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build megarl's byte-level BPE tokenizer from GSM8K text.")
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT / "data" / "gsm8k", help="holds test/train.jsonl")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "megarl" / "assets" / "tokenizer")
    parser.add_argument("--vocab-size", type=int, default=4096, help="total, special tokens included")
    args = parser.parse_args(argv)
    tokenizer = build(args.data_dir, args.out, args.vocab_size)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
