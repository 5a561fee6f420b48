"""Per-step metrics as pure functions of the step's batch: data, rollout-vs-trainer gap, throughput, timing."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.algo.stats import masked_mean
from megarl.config.trainer import TrainerConfig

logger = logging.getLogger("megarl")

GAP_HINT = "check that the engine and the trainer run the same weights, dtype and sampling temperature"


class RunStopped(RuntimeError):
    """A guard stopped the run (a diverging log-prob gap); the message says why and which setting to change."""


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the block's wall time to `timings["timing/<name>"]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{name}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def data_metrics(tensors: dict[str, torch.Tensor], max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished step batch."""
    mask = tensors["response_mask"].bool()
    prompt_width = tensors["prompts"].shape[1]
    response_lengths = tensors["attention_mask"][:, prompt_width:].sum(dim=1)
    metrics = _stats("reward/score", tensors["scores"])
    metrics |= _stats("reward/sequence_reward", tensors["token_level_rewards"].sum(dim=1))
    for key in ("advantages", "returns", "values"):
        if key in tensors:
            metrics |= _stats(f"critic/{key}" if key != "advantages" else "actor/advantages", tensors[key][mask])
    metrics |= _stats("response_length", response_lengths)
    metrics["response_length/clip_ratio"] = (response_lengths >= max_response_length).float().mean().item()
    metrics |= _stats("prompt_length", tensors["attention_mask"][:, :prompt_width].sum(dim=1))
    if "routing_tokens" in tensors:  # the old-log-prob pass replayed the engine's routing (R3)
        recorded = tensors["routing_tokens"].sum().clamp(min=1.0)
        metrics["router_replay/rollout_mismatch_frac"] = (tensors["routing_mismatch"].sum() / recorded).item()
    return metrics


def log_prob_gap(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's token log-probs are from the trainer's recomputation of the same tokens.

    |Δp| = |exp(rollout) − exp(trainer)| over model tokens (max, mean, std), and the KL between them
    estimated on the sampled tokens (k3, non-negative).
    """
    mask = mask.bool()
    rollout, trainer = rollout_log_probs[mask].double(), old_log_probs[mask].double()
    if rollout.numel() == 0:
        return {}
    diff = (rollout.exp() - trainer.exp()).abs()
    log_ratio = trainer - rollout
    kl = (log_ratio.exp() - 1 - log_ratio).mean()
    return {
        "rollout_gap/abs_diff/max": diff.max().item(),
        "rollout_gap/abs_diff/mean": diff.mean().item(),
        "rollout_gap/abs_diff/std": diff.std(unbiased=False).item(),
        "rollout_gap/kl": kl.item(),
    }


def check_log_prob_gap(metrics: dict[str, float], cfg: TrainerConfig) -> None:
    """Warn when a step's `rollout_gap/abs_diff/max` exceeds `trainer.log_prob_gap_warning`; stop the run (raise)
    when it exceeds `trainer.log_prob_gap_limit`. A NaN gap exceeds both."""
    gap = metrics.get("rollout_gap/abs_diff/max", 0.0)
    limit = cfg.log_prob_gap_limit
    if limit is not None and not gap <= limit:
        raise RunStopped(
            f"stopping the run: rollout vs trainer probabilities differ by up to {gap:.4f} "
            f"(> trainer.log_prob_gap_limit={limit:g}); {GAP_HINT}, or raise trainer.log_prob_gap_limit"
        )
    if not gap <= cfg.log_prob_gap_warning:
        logger.warning(
            "rollout vs trainer probabilities differ by up to %.4f (> trainer.log_prob_gap_warning=%g): %s",
            gap,
            cfg.log_prob_gap_warning,
            GAP_HINT,
        )


def entropy_metric(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {"actor/entropy": masked_mean(entropy, mask.float()).item()}


def throughput(attention_mask: torch.Tensor, step_seconds: float, num_devices: int) -> dict[str, float]:
    tokens = float(attention_mask.sum())
    return {
        "perf/total_tokens": tokens,
        "perf/tokens_per_s": tokens / step_seconds,
        "perf/tokens_per_s_per_device": tokens / step_seconds / num_devices,
    }
