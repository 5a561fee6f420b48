"""The CPU demo's task: name the largest of five numbers.

"Which is the largest of 4, 7, 1, 7, 3?" → "7". The answer is drawn uniformly from 4..9 and the other
four numbers uniformly below it (repeats allowed), so always saying "9" scores 1/6 and reading the
list is the only way to do better. Every digit is one token of the shipped tokenizer. Rows follow the
GSM8K row format (megarl.data.gsm8k) with data_source "megarl/largest" (reward: megarl.rewards.largest).

Train and test are disjoint: a list belongs to the test split iff `is_test(numbers)`, so every
validation prompt is one the policy never trained on.

`format_examples` are the supervised warm-up's targets (as chat rows for its SFT run, `write_sft_parquet`;
`+experiment=sft_largest`): one number of the list chosen at random, then end-of-turn. They teach the answer format (a
number from the question, then stop) and nothing about which number is right: a perfect imitator is right 1 time in ~4.
"""

import random
import zlib
from pathlib import Path
from typing import Any

from megarl.data.arith import write_rows

DATA_SOURCE = "megarl/largest"
NUM_NUMBERS = 5
MIN_ANSWER = 4


def draw_numbers(rng: random.Random) -> tuple[int, ...]:
    """Five digits whose largest is uniform over MIN_ANSWER..9, shuffled."""
    largest = rng.randint(MIN_ANSWER, 9)
    others = [rng.randint(0, largest - 1) for _ in range(NUM_NUMBERS - 1)]
    numbers = [largest, *others]
    rng.shuffle(numbers)
    return tuple(numbers)


def is_test(numbers: tuple[int, ...]) -> bool:
    """The held-out eighth of all lists (a fixed hash of the list)."""
    return zlib.crc32(bytes(numbers)) % 8 == 0


def question(numbers: tuple[int, ...]) -> str:
    return f"Which is the largest of {', '.join(map(str, numbers))}?"


def draw_split(rng: random.Random, split: str) -> tuple[int, ...]:
    """A list of the split: drawn again until `is_test` agrees with `split`."""
    while True:
        numbers = draw_numbers(rng)
        if is_test(numbers) == (split == "test"):
            return numbers


def make_rows(num_rows: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`num_rows` rows of `split` ("test" or anything else = train), deterministic for a seed."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        numbers = draw_split(rng, split)
        text = question(numbers)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": text}],
                "ability": "comparison",
                "reward_model": {"style": "rule", "ground_truth": str(max(numbers))},
                "extra_info": {"split": split, "index": index, "question": text},
            }
        )
    return rows


def format_examples(num_examples: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) pairs of training lists whose answer is a random member of the list."""
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        numbers = draw_split(rng, "train")
        examples.append((question(numbers), str(rng.choice(numbers))))
    return examples


def write_parquet(path: Path, num_rows: int, seed: int, split: str) -> int:
    """Write `make_rows(...)` to `path` atomically; returns the row count."""
    return write_rows(path, make_rows(num_rows, seed, split))


def write_sft_parquet(path: Path, num_rows: int, seed: int) -> int:
    """Write `format_examples(num_rows, seed)` in order as SFT chat rows (megarl.data.sft: a user question, the
    assistant's answer) to `path` atomically; returns the row count."""
    rows = [
        {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]}
        for text, answer in format_examples(num_rows, seed)
    ]
    return write_rows(path, rows)
