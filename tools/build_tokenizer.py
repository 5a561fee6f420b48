"""Build the tokenizer megarl ships (`megarl/assets/tokenizer/`) from the GSM8K text in the repo.

A byte-level BPE (individual digits, so arithmetic stays learnable) with ChatML specials and
Hermes tool-call markers, wrapped as a `PreTrainedTokenizerFast` with `chat_template.jinja`
beside this file. Deterministic: the same inputs give a byte-identical tokenizer.json.

    python tools/build_tokenizer.py [--out DIR] [--vocab-size 4096]
"""

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Control tokens: skipped by decode(skip_special_tokens=True)."""
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Single-token markers the model writes itself; kept by decode(skip_special_tokens=True)."""
CHAT_CORPUS = """You are a helpful assistant. You solve grade-school math problems.
Functions you can call are described in <tools></tools>, one JSON schema per line.
{"type": "function", "function": {"name": "check_answer", "description": "Check a final answer.",
"parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "The answer"}},
"required": ["answer"]}}}
{"name": "check_answer", "arguments": {"answer": "42"}}
{"name": "run_python", "arguments": {"code": "print(1 + 2)"}}
tool function parameters properties required type string number integer boolean array object description
The answer is correct. The answer is wrong. Try again. Let me check the answer with the tool.
"""


def corpus(data_dir: Path) -> Iterator[str]:
    """Training text: every GSM8K question and answer (sorted files, file order), then the chat corpus."""
    for path in sorted(data_dir.glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield row["question"]
                yield row["answer"]
    for _ in range(50):
        yield CHAT_CORPUS


def build(data_dir: Path, out: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train, wrap with the chat template, save to `out` and return the tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL + MARKERS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(data_dir), trainer)
    spec = json.loads(bpe.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = (Path(__file__).parent / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(str(out))
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=REPO / "megarl" / "assets" / "tokenizer")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    tokenizer = build(args.data_dir, args.out, args.vocab_size)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
