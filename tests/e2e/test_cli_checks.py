"""The CLIs as subprocesses: megarl-train refuses bad configs before spawning, megarl-preprocess writes rows."""

import subprocess
import sys
from pathlib import Path

from cases.cli_cases import megarl_train
from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.data import RLDataset
from megarl.data.arith import DATA_SOURCE


def test_cli_prints_moe_config() -> None:
    out = megarl_train("--cfg", "job", "--resolve", "model=tiny_moe")
    assert out.returncode == 0, out.stderr
    assert "models/tiny_moe" in out.stdout and "expert_model_parallel_size: 1" in out.stdout


def test_cli_rejects_bad_batch_sizes_before_spawning(data_overrides: list[str], tmp_path: Path) -> None:
    out = megarl_train(
        "data.train_batch_size=3",
        "rollout.n=5",
        "actor.ppo_mini_batch_size=4",
        f"trainer.run_dir={tmp_path}",
        *data_overrides,
    )
    assert out.returncode == 2
    assert "actor.ppo_mini_batch_size=4" in out.stderr and "data.train_batch_size=3" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_exits_2_when_every_prompt_is_over_long(data_overrides: list[str], tmp_path: Path) -> None:
    """Only the dataset build (tokenizer and chat template) sees this; it still ends before Ray starts."""
    out = megarl_train("data.max_prompt_length=5", f"trainer.run_dir={tmp_path}", *data_overrides)
    assert out.returncode == 2, out.stderr
    assert "plain.parquet']: all 40 prompts are over data.max_prompt_length=5 tokens" in out.stderr
    assert "raise data.max_prompt_length" in out.stderr
    assert "Traceback" not in out.stderr and "Started a local Ray instance" not in out.stdout + out.stderr


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


def test_cli_names_the_new_key_of_a_moved_one() -> None:
    """`trainer.mode` and `async_training.mode` became `trainer.driver`: the old keys are refused with it (exit 2)
    before Hydra, whose own error would not say where they went."""
    out = megarl_train("trainer.mode=train", "async_training.mode=fully_async")
    assert out.returncode == 2
    assert "trainer.mode was replaced by trainer.driver (train is now sync" in out.stderr
    assert "async_training.mode was replaced by trainer.driver (off is now sync" in out.stderr
    assert "Traceback" not in out.stderr
