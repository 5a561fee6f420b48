"""`megarl-warmup --output DIR`: the CPU demo's starting checkpoint, a short supervised warm-up.

RL post-training starts from a model that already answers in the task's format. This writes one:
the tiny dense model (megarl/assets/models/tiny_dense, random init from `--seed`) trained with
cross-entropy on `--steps` batches of `--batch-size` examples from `megarl.data.largest.format_examples`:
a training-split question, and as its answer a number of the list chosen at random, then end-of-turn.
The model learns to answer with one number of the question and stop, and nothing about which one is
right (the labels are random), so its accuracy stays near chance; the demo's RL raises it.

Deterministic: one CPU thread, fixed seeds. Writes `model.safetensors` + `config.json` (HF format,
loadable with `model.path=DIR model.random_init=false`) atomically, and `warmup.json` with the recipe
and the final loss.

    megarl-warmup --output runs/warmup/tiny_dense_largest [--steps 100 --batch-size 32 --lr 5e-3]
"""

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from megarl.assets import asset_path
from megarl.data.largest import format_examples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl-warmup", description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory to write the checkpoint to")
    parser.add_argument("--model", type=Path, default=asset_path("models/tiny_dense"), help="HF config directory")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (no weight decay)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and of the examples")
    return parser.parse_args(argv)


def encode(tokenizer: Any, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids with the chat template's generation prompt, answer ids + end-of-turn)."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    return prompt_ids, tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    """Right-padded input ids [b, s] and labels [b, s] (-100 everywhere but the answer)."""
    import torch

    length = max(len(p) + len(a) for p, a in pairs)
    input_ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(pairs):
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return input_ids, labels


def train(args: argparse.Namespace) -> tuple[Any, float]:
    """The warmed-up transformers model and its last batch's loss."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    examples = format_examples(args.steps * args.batch_size, args.seed)
    for step in range(args.steps):
        batch = examples[step * args.batch_size : (step + 1) * args.batch_size]
        input_ids, labels = collate([encode(tokenizer, q, a) for q, a in batch], tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, loss.item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, loss = train(args)
    staging = args.output.with_name(args.output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    recipe = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "output"}
    (staging / "warmup.json").write_text(json.dumps({**recipe, "final_loss": loss}, indent=2) + "\n")
    shutil.rmtree(args.output, ignore_errors=True)
    staging.replace(args.output)
    print(f"wrote {args.output} ({args.steps} steps of {args.batch_size}, final loss {loss:.3f})")


if __name__ == "__main__":
    main()
