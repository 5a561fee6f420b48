"""The training side's phases of a step, functions of the job's `Training` and the step's batch: old, reference
log-probs and values from the roles, advantages on the driver, the critic and actor updates, the step's metrics
and the rollout dump. The driver holds only `Batch`es; tensors on the workers stay there.
"""

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from megarl import algo
from megarl.batch import Batch
from megarl.config.training import reference_replays_routing
from megarl.rewards.score import Scored
from megarl.trainer import steps
from megarl.trainer.job import Training
from megarl.trainer.metrics import check_log_prob_gap, data_metrics, entropy_metric, log_prob_gap, throughput, timer
from megarl.trainer.rollout_dump import decode_prompts, dump_rollouts
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.reference import ReferenceHost
from megarl.workers.reward_model import RewardModelWorker
from megarl.workers.teacher import TeacherWorker

W = TypeVar("W", bound=RankWorker)


def train_on(
    training: Training, batch: Batch, scores: "Future[Scored]", step: int, timings: dict[str, float]
) -> dict[str, float]:
    """Everything after rollout up to the updates; adds the training columns to `batch`."""
    cfg, roles = training.cfg, training.roles
    metrics: dict[str, float] = {}
    _old_log_probs(training, batch, timings)
    if roles.ref is not None:
        with timer("ref", timings):
            replays = reference_replays_routing(cfg.actor)
            _union(batch, forward(training, roles.ref, ReferenceHost.compute_ref_log_prob, batch, routing=replays))
    if roles.critic is not None:
        with timer("values", timings):
            _union(batch, forward(training, roles.critic, CriticWorker.compute_values, batch))
    if roles.teacher is not None:
        with timer("teacher", timings):
            _union(batch, forward(training, roles.teacher, TeacherWorker.compute_teacher_log_prob, batch))
            roles.teacher.broadcast(RankWorker.release)  # with offload, off the device again through the updates
    with timer("reward", timings):
        scored = scores.result()
    if roles.rm is not None:
        with timer("rm", timings):
            rm_scores = forward(training, roles.rm, RewardModelWorker.compute_rm_scores, rm_inputs(batch))["rm_scores"]
            roles.rm.broadcast(RankWorker.release)  # with offload, off the device again through the updates
        scored = scored.with_component("rm", rm_scores, cfg.reward_model.discriminative.weight)
    with timer("adv", timings):
        scored.record(batch)
        batch.set("scores", steps.shaped_scores(batch, scored.scores, cfg.algorithm, cfg.data.max_response_length))
        steps.rollout_is_batch_mean(batch, cfg.algorithm)
        metrics |= scored.metrics | steps.compute_advantage(batch, cfg.algorithm, training.kl_ctrl)
        if cfg.algorithm.distillation.enable:
            metrics |= steps.distill(batch, cfg.algorithm.distillation)
    if roles.critic is not None:
        with timer("update_critic", timings):
            metrics |= update(training, roles.critic, CriticWorker.update, batch, step)
    if step > cfg.trainer.critic_warmup:
        with timer("update_actor", timings):
            replays = cfg.actor.router_replay != "disabled"
            metrics |= update(training, roles.actor, ActorWorker.update, batch, step, routing=replays)
    if cfg.trainer.dump_rollouts:
        dump(training, batch, step)
    return metrics


def rm_inputs(batch: Batch) -> Batch:
    """The Megatron RM's input: each row's `rm_token_ids` (the agent worker formatted the conversation with the RM's
    chat template) left-padded to the longest, their mask (also as `attention_mask`, which DP balancing reads)."""
    rows = list(batch["rm_token_ids"])
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return Batch.from_dict({"rm_input_ids": ids, "rm_attention_mask": mask, "attention_mask": mask})


def _old_log_probs(training: Training, batch: Batch, timings: dict[str, float]) -> None:
    """`old_log_probs` and `entropy` (and `sum_pi_squared` when the estimator reads it) from the actor. A loss
    in `algo.SKIPS_OLD_LOG_PROBS` (bypass) never reads π_old: it gets the rollout's log-probs instead, and
    the actor's pass runs only when the estimator needs Σπ²."""
    alg = training.cfg.algorithm
    skip = alg.policy_loss in algo.SKIPS_OLD_LOG_PROBS
    if skip:
        batch.set("old_log_probs", batch["rollout_log_probs"])
    if not skip or "sum_pi_squared" in algo.estimator_traits(alg.adv_estimator).needs:
        with timer("old_log_prob", timings):
            replays = training.cfg.actor.router_replay == "R3"  # R2 records its own routing here
            actor = training.roles.actor
            _union(batch, forward(training, actor, ActorWorker.compute_log_prob, batch, routing=replays))


def step_metrics(training: Training, batch: Batch, timings: dict[str, float], num_devices: int) -> dict[str, float]:
    """Data, entropy, rollout-vs-trainer gap, throughput and timing; warns on a large gap, stops on a larger one."""
    cfg = training.cfg
    tensors = {key: batch[key] for key in batch.tensor_keys}
    metrics = data_metrics(tensors, cfg.data.max_response_length) | timings
    if "entropy" in batch:  # the actor recomputed the log-probs (bypass skips it)
        metrics |= entropy_metric(batch["entropy"], batch["response_mask"])
        metrics |= log_prob_gap(batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    metrics |= throughput(batch["attention_mask"], timings["timing/step"], num_devices)
    metrics["timing/dispatch"] = _take_dispatch_seconds(training)
    check_log_prob_gap(metrics, cfg.trainer)
    return metrics


def dump(training: Training, batch: Batch, step: int) -> None:
    """`rollout_dumps/step_<k>.jsonl`: prompt, response, score, uid, the reward's components and extras, and the
    weight versions of its tokens."""
    extra: dict[str, list[Any]] = {"uid": [str(uid) for uid in batch["uid"]]}
    if "reward_extra" in batch:
        extra["reward"] = list(batch["reward_extra"])
    if "rollout_versions" in batch:
        extra["versions"] = [sorted({v for v in row.tolist() if v >= 0}) for row in batch["rollout_versions"]]
    texts = decode_prompts(batch, training.tokenizer), list(batch["response_text"])
    path = Path(training.cfg.trainer.run_dir) / "rollout_dumps" / f"step_{step:06d}.jsonl"
    dump_rollouts(path, step, *texts, batch["scores"].tolist(), extra)


def _union(batch: Batch, columns: Batch) -> None:
    for key in columns.tensor_keys:
        batch.set(key, columns[key])


def forward(
    training: Training,
    group: WorkerGroup[W],
    method: Callable[[W, Batch], Batch],
    batch: Batch,
    routing: bool = False,
) -> Batch:
    """`method` over DP shards of equal token counts; rows back in `batch`'s order. `routing`: the role replays
    routings, so `routed_experts` travels too (`steps.shipped`)."""
    with timer("dispatch", training.dispatch):
        ordered, inverse = steps.balanced(steps.shipped(batch, routing), group.dp_size)
    results = group.split_dp(method, ordered)
    with timer("dispatch", training.dispatch):
        return group.from_dp_leaders(results)[inverse]


def update(
    training: Training,
    group: WorkerGroup[W],
    method: Callable[[W, Batch, int], dict[str, float]],
    batch: Batch,
    step: int,
    routing: bool = False,
) -> dict[str, float]:
    """`method` over DP shards of equal token counts (`routing`: as in `forward`); the first rank's metrics."""
    with timer("dispatch", training.dispatch):
        ordered, _ = steps.balanced(steps.shipped(batch, routing), group.dp_size)
    return group.split_dp(method, ordered, step)[0]


def _take_dispatch_seconds(training: Training) -> float:
    """Driver time spent balancing, cutting, shipping and reassembling batches since the last call."""
    groups = training.roles.all()
    seconds = training.dispatch.pop("timing/dispatch", 0.0) + sum(g.dispatch_seconds for g in groups)
    for group in groups:
        group.dispatch_seconds = 0.0
    return seconds
