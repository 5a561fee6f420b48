"""The rollout side's phases: a step's trajectories and their scores, ReMax baselines, validation.

Each is a function of the job's `Rollout` (the agent workers, which score each trajectory as it finishes, the
validation prompts) and the prompt stream; none touches a Megatron role.
"""

from concurrent.futures import Future

import numpy as np
import torch

from megarl import algo
from megarl.batch import Batch
from megarl.rewards.score import Scored
from megarl.trainer import steps
from megarl.trainer.eval_metrics import validation_metrics
from megarl.trainer.job import Prompts, Rollout


def collect(rollout: Rollout, prompts: Prompts, step: int) -> tuple[Batch, "Future[Scored]", dict[str, float]]:
    """The step's trajectories (DAPO dynamic sampling: only prompts whose samples differ) and their scores (the
    agent workers scored each as it finished)."""
    cfg = rollout.cfg
    kept: list[Batch] = []
    num_kept = num_seen = rounds = 0
    metrics: dict[str, float] = {}
    while True:
        rounds += 1
        drawn = prompts.next()
        samples = steps.samples_of(drawn, cfg.rollout.n, f"{step}.{rounds}")
        out, metrics = rollout.manager.rollout(samples, seed=round_seed(cfg.trainer.seed, step, rounds))
        batch = steps.with_rollout(samples, out)
        if "baseline_scores" in algo.estimator_traits(cfg.algorithm.adv_estimator).needs:
            batch.set("baseline_scores", greedy_baseline(rollout, drawn, step))
        scored = Scored.of_rollout(batch)
        if not cfg.algorithm.filter_groups.enable:
            return batch, done(scored), metrics
        scored.record(batch)
        batch, kept_prompts, seen = steps.keep_varied_groups(batch)
        kept.append(batch)
        num_kept, num_seen = num_kept + kept_prompts, num_seen + seen
        limit = cfg.algorithm.filter_groups.max_num_gen_batches
        if num_kept >= cfg.data.train_batch_size:
            break
        if limit and rounds >= limit:
            raise RuntimeError(
                f"dynamic sampling kept {num_kept} of {cfg.data.train_batch_size} prompts after {rounds} "
                "generation rounds (algorithm.filter_groups.max_num_gen_batches); raise it or set it to 0"
            )
    full = Batch.concat(kept)[: cfg.data.train_batch_size * cfg.rollout.n]
    metrics |= {"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_prompt_ratio": num_kept / num_seen}
    return full, done(Scored.of(full)), metrics


def round_seed(seed: int, step: int, rounds: int) -> int:
    """The rollout seed of generation round `rounds` of step `step` (row i samples with it + 1000·i)."""
    return seed + 1_000_003 * step + 7919 * rounds


def done(scored: Scored) -> "Future[Scored]":
    """`scored` as a finished future (what `train_on` waits on)."""
    future: Future[Scored] = Future()
    future.set_result(scored)
    return future


def greedy_baseline(rollout: Rollout, prompts: Batch, step: int) -> torch.Tensor:
    """ReMax: each prompt's greedy response scored, repeated for its n samples."""
    samples = steps.samples_of(prompts, 1, f"{step}.greedy")
    out, _ = rollout.manager.rollout(samples, validate=True)
    return Scored.of_rollout(steps.with_rollout(samples, out)).scores.repeat_interleave(rollout.cfg.rollout.n)


def validation_due(rollout: Rollout, step: int, last: bool) -> bool:
    """Validation runs at this step (`trainer.test_freq`, and a validation set exists)."""
    freq = rollout.cfg.trainer.test_freq
    return freq > 0 and due(freq, step, last) and rollout.val_loader is not None


def due(freq: int, step: int, last: bool) -> bool:
    """Every `freq` steps and at the last (freq 0: only the last)."""
    return last or (freq > 0 and step % freq == 0)


def evaluate(rollout: Rollout, step: int) -> dict[str, float]:
    """`val/…` metrics: mean score overall, response length, and per data source the mean score and the
    n-sample metrics (mean@n, pass@k, best@k, worst@k, maj@k: `trainer/eval_metrics.py`); none without a
    validation set."""
    cfg = rollout.cfg
    sources: list[str] = []
    uids: list[str] = []
    scores: list[float] = []
    answers: list[str | None] = []
    lengths: list[float] = []
    for i, prompts in enumerate(rollout.val_loader or []):
        samples = steps.samples_of(prompts, cfg.rollout.val.n, f"val{step}.{i}")
        out, _ = rollout.manager.rollout(samples, validate=True, seed=cfg.trainer.seed)
        batch = steps.with_rollout(samples, out)
        scores += batch["scores"].tolist()
        answers += list(batch["reward_answer"])
        sources += [str(source) for source in batch["data_source"]]
        uids += [str(uid) for uid in batch["uid"]]
        lengths += batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(dim=1).float().tolist()
    if not scores:
        return {}
    threshold, seed = cfg.trainer.val_pass_threshold, cfg.trainer.seed
    metrics = {f"val/{k}": v for k, v in validation_metrics(sources, uids, scores, answers, threshold, seed).items()}
    metrics["val/response_length/mean"] = float(np.mean(lengths))
    return metrics
