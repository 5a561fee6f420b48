"""`RolloutManager`: the driver's handle on rollout. Splits a prompt `Batch` across agent workers
(Ray actors), gathers their padded outputs in the original row order, and reports timing metrics.

    manager = RolloutManager(settings, urls, keys, num_workers=2)
    out, metrics = manager.rollout(prompts)               # prompts: raw_prompt_ids, raw_prompt, ...
    val, _ = manager.rollout(val_prompts, validate=True)   # rollout.val sampling (greedy by default)

The manager only generates: the engines' memory, pauses and weights are the trainer's (`megarl.engines.client.fleet`).
"""

import time
from typing import Any

import numpy as np
import ray

from megarl.agents.worker import AgentSettings, AgentWorker
from megarl.batch import MULTI_MODAL_COLUMN, Batch
from megarl.engines.client.auth import EngineKeys


class RolloutManager:
    def __init__(
        self,
        settings: AgentSettings,
        urls: list[str],
        keys: EngineKeys | None = None,
        num_workers: int = 1,
    ) -> None:
        """Agent workers on the engines at `urls`, every request carrying the key `keys` holds for it."""
        if num_workers < 1:
            raise ValueError(f"rollout.num_agent_workers={num_workers} must be >= 1")
        actor = ray.remote(AgentWorker).options(num_cpus=0, scheduling_strategy="SPREAD")
        self.workers: list[Any] = [actor.remote(settings, urls, keys) for _ in range(num_workers)]
        """ray.actor.ActorHandle[AgentWorker] each (Ray ships no type information)."""
        self._next_worker = 0

    def rollout(self, batch: Batch, validate: bool = False, seed: int | None = None) -> tuple[Batch, dict[str, float]]:
        """Rollout columns for every row of `batch` (see megarl.agents.postprocess) and `rollout/…` metrics."""
        started = time.perf_counter()
        num_rows, num_workers = len(batch), len(self.workers)
        sizes = [num_rows // num_workers + (w < num_rows % num_workers) for w in range(num_workers)]
        starts = np.cumsum([0, *sizes[:-1]])
        refs = [
            worker.rollout_rows.remote(part, validate, seed, int(start))
            for worker, part, start in zip(self.workers, batch.split(sizes), starts, strict=True)
            if len(part)
        ]
        results = ray.get(refs)
        out = Batch.concat([part for part, _ in results])
        metrics = rollout_metrics(out) | {
            "rollout/gen_seconds": time.perf_counter() - started,
            "rollout/worker_seconds_max": max(seconds for _, seconds in results),
        }
        return out, metrics

    def submit(self, rows: Batch, seed: int | None, first_row: int) -> Any:
        """Start rolling out `rows` on the next agent worker (round robin) without waiting; row i samples with
        seed + 1000·(first_row + i). `ray.get` the returned ref for (rollout Batch, wall seconds)."""
        worker = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        return worker.rollout_rows.remote(rows, False, seed, first_row)

    def dead_replicas(self) -> set[int]:
        """Replicas some agent worker's router gave up on (they failed or timed out a request)."""
        health = ray.get([worker.engine_health.remote() for worker in self.workers])
        return {i for alive, _ in health for i, up in enumerate(alive) if not up}

    def readmit(self) -> dict[str, float]:
        """Every router checks every replica now and takes back the ones that answer; `engines/live_replicas` (the
        fewest any router takes) and `engines/retried_requests` (over the run)."""
        health = ray.get([worker.readmit.remote() for worker in self.workers])
        return {
            "engines/live_replicas": float(min(sum(alive) for alive, _ in health)),
            "engines/retried_requests": float(sum(retried for _, retried in health)),
        }

    def use_adapter(self, name: str | None) -> None:
        """Every worker's requests name LoRA adapter `name` from now on (loaded on every replica by the actor's
        sync); each worker's router unloads the previous one once its requests with it have ended."""
        ray.get([worker.use_adapter.remote(name) for worker in self.workers])

    def close(self) -> None:
        ray.get([worker.close.remote() for worker in self.workers])
        for worker in self.workers:
            ray.kill(worker)


def rollout_metrics(out: Batch) -> dict[str, float]:
    """Response length, turns, tool use and finish reasons of one rollout batch."""
    lengths = out["attention_mask"][:, out["prompts"].shape[1] :].sum(dim=1).float()
    model_tokens = out["response_mask"].sum(dim=1).float()
    metrics = {
        "rollout/response_length/mean": lengths.mean().item(),
        "rollout/response_length/max": lengths.max().item(),
        "rollout/model_tokens/mean": model_tokens.mean().item(),
        "rollout/num_turns/mean": out["num_turns"].float().mean().item(),
        "rollout/num_turns/max": out["num_turns"].max().item(),
    }
    keys = ["num_tool_calls", "num_tool_errors", "num_parse_errors", "tool_seconds", "num_resubmits"]
    keys += sorted({key for m in out["agent_metrics"] for key in m if key.startswith("openai/")})
    for key in keys:
        values = [m.get(key, 0.0) for m in out["agent_metrics"]]
        metrics[f"rollout/{key}/mean"] = float(np.mean(values))
    if MULTI_MODAL_COLUMN in out:  # a vision-language rollout: images per trajectory, its prompt's and its tools'
        images = [len(row["image_grid_thw"]) if row is not None else 0 for row in out[MULTI_MODAL_COLUMN]]
        metrics["rollout/images/mean"] = float(np.mean(images))
    reasons, counts = np.unique(np.asarray(out["finish_reason"], dtype=str), return_counts=True)
    metrics |= {f"rollout/finish/{r}": c / len(out) for r, c in zip(reasons, counts, strict=True)}
    return metrics
