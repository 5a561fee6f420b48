"""`megarl-train` end to end with a vision-language model on CPU: GRPO on image prompts whose tool answers with an
image. Ray pools, Megatron TP=2 over gloo with the frozen vision tower on both ranks, two embedded engines serving
Qwen2.5-VL, resharding of the vision weights, and the tool loop's images reaching the trainer."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cases.vision_agent_cases import QUESTION, colour_model
from conftest import REPO
from PIL import Image

from megarl.assets import asset_path
from megarl.data.arith import write_rows

EXE = Path(sys.executable).with_name("megarl-train")


def _blue_square() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (40, 70, 230)).save(buffer, format="PNG")
    return buffer.getvalue()


def _rows(num_rows: int, split: str) -> list[dict]:
    """The colour model's script prompt, offered the `show_colour` tool, with its blue square; the tool rewards
    showing red on even rows and blue on odd ones (the model always shows red: scores 1 and 0)."""
    return [
        {
            "data_source": "megarl/shapes",
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            "images": [_blue_square()],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": "blue"},
            "extra_info": {
                "split": split,
                "index": i,
                "agent_name": "tool_agent",
                "tools_kwargs": {"show_colour": {"create_kwargs": {"ground_truth": ("red", "blue")[i % 2]}}},
            },
        }
        for i in range(num_rows)
    ]


def test_grpo_with_a_tool_that_answers_with_an_image_trains(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("vision_e2e")
    write_rows(root / "train.parquet", _rows(2, "train"))  # one even and one odd row in every step
    write_rows(root / "test.parquet", _rows(2, "test"))
    model = colour_model(tmp_path_factory, _blue_square())
    run_dir = root / "run"
    command = [
        str(EXE),
        "--config-name",
        "demo_cpu",
        "model=tiny_qwen2_5_vl",
        f"model.path={model}",
        "model.random_init=false",
        f"data.train_files=[{root}/train.parquet]",
        f"data.val_files=[{root}/test.parquet]",
        "data.max_prompt_length=256",
        "data.max_response_length=128",
        f"rollout.multi_turn.tool_config_path={asset_path('tools/shapes.yaml')}",
        "trainer.val_before_train=false",
        f"trainer.run_dir={run_dir}",
        "data.train_batch_size=2",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_device=4",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.progress_bar=false",
        "trainer.dump_rollouts=true",
        "algorithm.adv_estimator=reinforce_plus_plus",  # normalised over the batch: the prompts' scores differ
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/grad_norm" in m]
    assert len(steps) == 2
    for m in steps:
        # the overfit model follows its script: one call, one tool image, so two images a trajectory
        assert m["rollout/num_tool_calls/mean"] > 0.5 and m["rollout/images/mean"] > 1.5
        assert m["reward/score/mean"] == 0.5 and m["actor/grad_norm"] > 0
    # the trainer read every trajectory's images: its first stage refuses a micro-batch whose image tokens and
    # patches disagree (megarl.megatron.vision.decoder_input), so the run above finishing is that check
    dumps = [json.loads(line) for path in sorted((run_dir / "rollout_dumps").glob("step_*.jsonl"))
             for line in path.read_text().splitlines()]  # fmt: skip
    assert len(dumps) == 8  # 2 steps × 2 prompts × n=2
    assert all(row["prompt"].count("<|image_pad|>") == 4 for row in dumps)  # the 56×56 square: 2×2 merged patches
    assert any("This is red." in row["response"] for row in dumps)  # the tool's answer beside its image
