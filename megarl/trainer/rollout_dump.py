"""Rollouts on disk: readable JSONL dumps, and whole step batches for rollout-only / train-only runs."""

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from megarl.batch import Batch

_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def dump_rollouts(
    path: Path,
    step: int,
    prompts: list[str],
    responses: list[str],
    scores: list[float],
    extra: dict[str, list[Any]] | None = None,
) -> None:
    """Write `path` with one JSON line per sample: step, prompt, response, score (and `extra`'s i-th values).

    Written atomically and replaced whole: a step trained again after a resume replaces what the killed run
    wrote for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = extra or {}
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for i, (prompt, response, score) in enumerate(zip(prompts, responses, scores, strict=True)):
            row = {"step": step, "prompt": prompt, "response": response, "score": score}
            row |= {key: values[i] for key, values in extra.items()}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def decode_prompts(batch: Batch, tokenizer: Any) -> list[str]:
    """Each row's prompt tokens (no padding, special tokens kept) as text."""
    prompt_width = batch["prompts"].shape[1]
    mask = batch["attention_mask"][:, :prompt_width].bool()
    return [
        tokenizer.decode(ids[m].tolist(), skip_special_tokens=False)
        for ids, m in zip(batch["prompts"], mask, strict=True)
    ]


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_rollout_batch(directory: Path, step: int, batch: Batch) -> Path:
    """`directory/step_<k>.pt` (written atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(batch, tmp)
    os.replace(tmp, path)
    return path


def load_rollout_batches(directory: Path) -> list[tuple[int, Batch]]:
    """Every saved step batch, in step order."""
    found = sorted((int(m.group(1)), p) for p in Path(directory).glob("step_*.pt") if (m := _STEP_FILE.match(p.name)))
    if not found:
        raise FileNotFoundError(
            f"no step_<k>.pt rollout batches in {directory}: run trainer.driver=rollout_only first "
            "with the same trainer.rollout_data_dir"
        )
    return [(step, torch.load(path, weights_only=False)) for step, path in found]
