"""Every policy loss added for issue 24 runs one actor update through `ActorWorker` (Megatron over gloo, tiny
model, one CPU rank): the registry name reaches the engine's loss and the step moves the weights."""

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from cases.megatron_cases import sample_batch
from conftest import compose_config

from megarl.batch import Batch
from megarl.config.root import MegarlConfig
from megarl.megatron.launch import spawn
from megarl.workers.actor import ActorWorker
from megarl.workers.settings import ActorSettings

NEW_LOSSES = {
    "cispo": "pg_clipfrac_high",
    "sapo": "sapo_gate_weight",
    "gmpo": "pg_clipfrac_low",
    "dppo_tv": "dppo_ratio_capped_frac",
    "dppo_kl": "dppo_ratio_capped_frac",
    "clip_cov": "clip_cov_frac",
    "kl_cov": "kl_cov_frac",
    "gpg": "ppo_kl",
    "dro": "ppo_kl",
    "bypass": "rollout_is_weight_mean",
}
"""Name → a metric only (or also) that loss reports."""


def rank_updates(cfg: MegarlConfig, names: list[str]) -> dict[str, tuple[dict[str, float], float]]:
    """On a one-rank gloo world: the actor worker in-process (what Ray wraps), one update per loss name.
    Returns each name's metrics and the largest change of the log-probs that its update caused."""
    worker = ActorWorker(rank=0, world_size=1, device="cpu")
    settings = ActorSettings.from_config(cfg, total_steps=len(names))
    worker.setup(settings, engine_urls=[])
    tensors = sample_batch(4096, num_rows=8, prompt_len=6, response_len=5, seed=3)
    batch = Batch.from_dict(tensors)
    g = torch.Generator().manual_seed(0)
    mask = tensors["response_mask"].float()
    batch.set("advantages", torch.randn(mask.shape, generator=g) * mask)
    out = {}
    for step, name in enumerate(names):
        old = worker.compute_log_prob(batch)["old_log_probs"]
        batch.set("old_log_probs", old)
        batch.set("rollout_log_probs", old + 0.05 * torch.randn(mask.shape, generator=g) * mask)
        worker.settings = replace(settings, algorithm=replace(cfg.algorithm, policy_loss=name))
        metrics = worker.update(batch, step)
        change = (worker.compute_log_prob(batch)["old_log_probs"] - old).abs().max()
        out[name] = (metrics, float(change))
    return out


@pytest.fixture(scope="module")
def updates() -> dict[str, tuple[dict[str, float], float]]:
    cfg = compose_config(
        "trainer=cpu",
        "trainer.devices_per_node=1",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=4",
        "algorithm.use_kl_loss=false",
        "algorithm.loss_params.dro_beta=0.05",
        "algorithm.loss_params.clip_cov_lb=-1000",
        "algorithm.loss_params.clip_cov_ratio=0.2",
    )
    result: dict[str, Any] = spawn(rank_updates, 1, cfg, list(NEW_LOSSES))[0]
    return result


@pytest.mark.parametrize("name", list(NEW_LOSSES))
def test_each_new_loss_takes_an_actor_step(updates: dict[str, tuple[dict[str, float], float]], name: str) -> None:
    metrics, change = updates[name]
    assert f"actor/{NEW_LOSSES[name]}" in metrics
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["actor/grad_norm"] > 0 and change > 1e-5
