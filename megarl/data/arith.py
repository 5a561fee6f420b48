"""A synthetic task a random-init tiny model can learn with RL in minutes: single-digit addition.

"What is 3 + 4? Answer with one digit." → "7", for the 55 pairs (a, b) with a + b ≤ 9. Every digit
is one token of the shipped tokenizer, so the answer is a single token. Rows follow the GSM8K row
format (megarl.data.gsm8k) with data_source "megarl/arith" (reward: megarl.rewards.arith). Train
and test splits draw from the same 55 pairs with different seeds, so they overlap: the task
measures whether RL moves the policy, not generalisation.
"""

import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "megarl/arith"
PAIRS = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def make_rows(num_rows: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`num_rows` rows drawn uniformly from the pairs (deterministic for a seed)."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        a, b = rng.choice(PAIRS)
        question = f"What is {a} + {b}? Answer with one digit."
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index, "question": question},
            }
        )
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> int:
    """Write `rows` to the parquet file `path` atomically; returns the row count."""
    import datasets

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp))
    tmp.replace(path)
    return len(rows)


def write_parquet(path: Path, num_rows: int, seed: int, split: str) -> int:
    """Write `make_rows(...)` to `path` atomically; returns the row count."""
    return write_rows(path, make_rows(num_rows, seed, split))
