"""Trajectory scores on the driver: the rule reward of each row's data_source, or the agent loop's reward.

A row whose agent loop produced a reward (`loop_reward` is not None: a tool or an interaction judged
it) is scored by that reward; every other row by `get_reward_fn(data_source, reward.function)` on its
decoded response. `RewardResult.extra` values become `reward/<name>/mean` metrics.
"""

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from megarl.config.trainer import RewardConfig
from megarl.protocol import Batch
from megarl.rewards import RewardResult, get_reward_fn


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """Each row's response tokens (model and tool/user turns, no padding) as text."""
    prompt_width = batch["prompts"].shape[1]
    mask = batch["attention_mask"][:, prompt_width:].bool()
    return [
        tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
        for ids, m in zip(batch["responses"], mask, strict=True)
    ]


def decode_prompts(batch: Batch, tokenizer: Any) -> list[str]:
    prompt_width = batch["prompts"].shape[1]
    mask = batch["attention_mask"][:, :prompt_width].bool()
    return [
        tokenizer.decode(ids[m].tolist(), skip_special_tokens=False)
        for ids, m in zip(batch["prompts"], mask, strict=True)
    ]


def score_each(batch: Batch, tokenizer: Any, cfg: RewardConfig) -> list[RewardResult]:
    """Each finished trajectory's result: its agent loop's reward (no extra, no answer) when it has one,
    else its reward function's."""
    responses = decode_responses(batch, tokenizer)
    loop_rewards = batch["loop_reward"] if "loop_reward" in batch else [None] * len(batch)
    results = []
    for i, (response, loop_reward) in enumerate(zip(responses, loop_rewards, strict=True)):
        if loop_reward is not None:
            results.append(RewardResult(float(loop_reward)))
            continue
        source = str(batch["data_source"][i])
        truth = str((batch["reward_model"][i] or {}).get("ground_truth", ""))
        results.append(get_reward_fn(source, cfg.function)(response, truth, batch["extra_info"][i], **cfg.kwargs))
    return results


def score_batch(batch: Batch, tokenizer: Any, cfg: RewardConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """(scores `[b]` float32, `reward/…` metrics) of finished trajectories."""
    results = score_each(batch, tokenizer, cfg)
    scores = torch.tensor([float(result.score) for result in results], dtype=torch.float32)
    extras: dict[str, list[float]] = defaultdict(list)
    for result in results:
        for key, value in result.extra.items():
            if isinstance(value, int | float | bool):
                extras[key].append(float(value))
    metrics = {f"reward/{key}/mean": float(np.mean(values)) for key, values in extras.items()}
    return scores, metrics
