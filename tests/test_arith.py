"""The synthetic addition task: rows, reward, preprocessing CLI, and loading through RLDataset."""

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.data import RLDataset
from megarl.data.arith import DATA_SOURCE, make_rows
from megarl.rewards import get_reward_fn


def test_rows_are_deterministic_and_correct() -> None:
    rows = make_rows(50, seed=3, split="train")
    assert rows == make_rows(50, seed=3, split="train") and rows != make_rows(50, seed=4, split="train")
    for row in rows:
        a, b = (int(x) for x in row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert row["reward_model"]["ground_truth"] == str(a + b) and a + b <= 9
        assert row["data_source"] == DATA_SOURCE


def test_reward_scores_the_first_number() -> None:
    reward = get_reward_fn(DATA_SOURCE)
    assert reward("7", "7").score == 1.0 and reward(" 7 is it", "7").extra == {"acc": 1.0, "has_number": 1.0}
    assert reward("3", "7").score == 0.1
    assert reward("no digits", "7").score == 0.0
    assert reward("12", "1").score == 0.1  # 12 is not 1
    assert reward("x5", "7", format_score=0.0).score == 0.0


def test_preprocess_cli_writes_rows_that_load_and_render(tmp_path: Path) -> None:
    out = tmp_path / "arith.parquet"
    exe = Path(sys.executable).with_name("megarl-preprocess")
    done = subprocess.run(
        [str(exe), "arith", "--output", str(out), "--num-rows", "32", "--seed", "1", "--split", "test"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 32 rows (test)" in done.stdout
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    dataset = RLDataset([str(out)], tokenizer, max_prompt_length=64)
    assert len(dataset) == 32 and dataset.num_filtered == 0
    row = dataset[0]
    assert "Answer with one digit." in tokenizer.decode(row["prompt_ids"])
    assert row["data_source"] == DATA_SOURCE and row["reward_model"]["ground_truth"].isdigit()
