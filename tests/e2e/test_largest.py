"""The CPU demo's task and starting checkpoint: rows, held-out split, reward, preprocessing, and the
format-only warm-up (an SFT run, `+experiment=sft_largest`) that the shipped demo config trains from."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.agents.chat_tokens import ChatTokens
from megarl.assets import asset_path
from megarl.data import RLDataset, SFTDataset, collate_sft
from megarl.data.largest import DATA_SOURCE, format_examples, is_test, make_rows
from megarl.plan.gate import validate
from megarl.rewards import get_reward_fn

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def _parse(question: str) -> tuple[int, ...]:
    return tuple(int(x) for x in question.removeprefix("Which is the largest of ").removesuffix("?").split(", "))


def _numbers(row: dict) -> tuple[int, ...]:
    return _parse(row["prompt"][0]["content"])


def test_rows_are_deterministic_answer_the_largest_and_hold_out_the_test_lists() -> None:
    train, test = make_rows(600, seed=0, split="train"), make_rows(200, seed=1, split="test")
    assert train == make_rows(600, seed=0, split="train") and train != make_rows(600, seed=2, split="train")
    for row in train + test:
        assert row["reward_model"]["ground_truth"] == str(max(_numbers(row))) and row["data_source"] == DATA_SOURCE
    assert not {_numbers(r) for r in train} & {_numbers(r) for r in test}
    assert all(is_test(_numbers(r)) for r in test) and not any(is_test(_numbers(r)) for r in train)
    answers = Counter(r["reward_model"]["ground_truth"] for r in train)
    assert set(answers) == {"4", "5", "6", "7", "8", "9"} and max(answers.values()) < 0.25 * len(train)


def test_format_examples_answer_with_a_random_member_of_a_training_list() -> None:
    examples = format_examples(400, seed=0)
    lists = [
        tuple(int(x) for x in q.removeprefix("Which is the largest of ").removesuffix("?").split(", "))
        for q, _ in examples
    ]
    assert all(int(a) in numbers and not is_test(numbers) for (_, a), numbers in zip(examples, lists, strict=True))
    right = sum(int(a) == max(numbers) for (_, a), numbers in zip(examples, lists, strict=True)) / len(examples)
    assert 0.15 < right < 0.4  # the labels carry the format, not the answer


def test_reward_is_one_for_the_largest_and_zero_otherwise() -> None:
    reward = get_reward_fn(DATA_SOURCE)
    assert reward("7", "7").score == 1.0 and reward("7", "7").extra == {"acc": 1.0, "has_number": 1.0}
    assert reward("5", "7").score == 0.0 and reward("none", "7").score == 0.0


def _run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=ENV, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def warmup_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's warm-up recipe (`trainer.mode=sft +experiment=sft_largest`) in two runs: 40 steps (a checkpoint at
    the last), then resumed to its 100, with the validation loss every 50 steps; the actor exported as HF at the end
    of each."""
    root = tmp_path_factory.mktemp("warmup")
    _run("megarl-preprocess", "largest-sft", "--output", str(root / "sft.parquet"), "--num-rows", "3200")
    _run("megarl-preprocess", "largest-sft", "--output", str(root / "val.parquet"), "--num-rows", "48", "--seed", "9")
    common = (
        "trainer.mode=sft",
        "+experiment=sft_largest",
        f"data.train_files=[{root / 'sft.parquet'}]",
        f"data.val_files=[{root / 'val.parquet'}]",
        f"trainer.run_dir={root / 'run'}",
        f"sft.hf_output={root / 'ckpt'}",
        "trainer.test_freq=50",
        "trainer.progress_bar=false",
    )
    _run("megarl-train", *common, "trainer.total_training_steps=40")
    resumed = _run("megarl-train", *common)
    log = resumed.stdout + resumed.stderr
    assert "resumed from" in log and "(step 40)" in log
    return root / "ckpt"


def test_sft_warmup_logs_every_step_once_and_its_validation_loss_is_the_exported_models(warmup_dir: Path) -> None:
    """The SFT run's metrics across the resume, and `val/loss` at its last step equal to transformers' masked
    cross-entropy of the exported HF model on the same validation conversations."""
    records = [json.loads(line) for line in (warmup_dir.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "actor/loss" in r]
    assert steps == list(range(1, 101))
    losses = {r["step"]: r["actor/loss"] for r in records if "actor/loss" in r}
    assert losses[1] > 5.0 and losses[100] < 1.5  # from ln(vocab) to about the entropy of a random list member
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert set(val) == {40, 50, 100} and val[100] < val[50] < val[40]  # each run validates at its last step too
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    data = SFTDataset([str(warmup_dir.parent / "val.parquet")], ChatTokens(tokenizer), max_length=64)
    batch = collate_sft([data[i] for i in range(len(data))], tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(warmup_dir).float()
    width = batch["responses"].shape[1]
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, -width:] = torch.where(batch["response_mask"].bool(), batch["responses"], -100)
    mask = batch["attention_mask"]
    with torch.no_grad():
        loss = model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"], labels=labels
        )
    assert abs(loss.loss.item() - val[100]) <= 1e-5 * val[100]


def test_warmup_answers_in_format_near_chance_and_the_demo_config_accepts_it(warmup_dir: Path, tmp_path: Path) -> None:
    """Greedy on held-out lists: every answer is a number of the question followed by end-of-turn, and
    the right one only about as often as chance (the RL phase is what raises it)."""
    data = tmp_path / "test.parquet"
    preprocess = [str(BIN / "megarl-preprocess"), "largest", "--output", str(data), "--num-rows", "64", "--seed", "1"]
    assert subprocess.run([*preprocess, "--split", "test"], capture_output=True).returncode == 0
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    assert len(RLDataset([str(data)], tokenizer, max_prompt_length=64)) == 64
    model = AutoModelForCausalLM.from_pretrained(warmup_dir)
    chat = ChatTokens(tokenizer)
    rows = make_rows(64, seed=1, split="test")
    in_format = right = 0
    for row in rows:
        prompt = chat.encode(row["prompt"], add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=2)
        answer = out[0, len(prompt) :].tolist()
        in_format += answer[-1] == tokenizer.eos_token_id and int(tokenizer.decode(answer[:-1])) in _numbers(row)
        right += tokenizer.decode(answer[:-1]) == row["reward_model"]["ground_truth"]
    assert in_format >= 0.6 * len(rows) and right <= 0.4 * len(rows)
    paths = [f"model.path={warmup_dir}", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]
    validate(compose_config(*paths, config_name="demo_cpu"))
