"""The driver's arithmetic between worker calls, as pure functions of `Batch`es."""

from typing import Any

import torch

from megarl import algo
from megarl.algo.distill import distillation_advantages
from megarl.batch import MULTI_MODAL_COLUMN, ROUTING_COLUMN, Batch
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.distill import DistillationConfig
from megarl.rewards.score import reward_components
from megarl.trainer.balance import dp_order

GENERATION_TENSORS = ("input_ids", "attention_mask", "position_ids")
"""The prompt loader's padded tensors; rollout produces its own, so they leave the prompt batch."""


def samples_of(prompts: Batch, n: int, tag: str) -> Batch:
    """Each prompt's uid (`<tag>:<row>`), then each prompt n times in a row (r0 r0 r1 r1 …)."""
    prompts = prompts.select(tensor_keys=[k for k in prompts.tensor_keys if k not in GENERATION_TENSORS])
    prompts.set("uid", [f"{tag}:{i}" for i in range(len(prompts))])
    return prompts.repeat(n, interleave=True)


def with_rollout(samples: Batch, out: Batch) -> Batch:
    """The samples' columns and their rollout's; a trajectory's images (`multi_modal_inputs`: its prompt's and those
    its tools returned) replace its prompt's."""
    if MULTI_MODAL_COLUMN in out and MULTI_MODAL_COLUMN in samples:
        samples = samples.select(non_tensor_keys=[k for k in samples.non_tensor_keys if k != MULTI_MODAL_COLUMN])
    return samples.union(out)


def shaped_scores(batch: Batch, scores: torch.Tensor, cfg: AlgorithmConfig, max_response_length: int) -> torch.Tensor:
    """Scores plus the DAPO over-long penalty when enabled."""
    if not cfg.overlong_buffer.enable:
        return scores
    prompt_width = batch["prompts"].shape[1]
    lengths = batch["attention_mask"][:, prompt_width:].sum(dim=1)
    buffer = cfg.overlong_buffer
    return scores + algo.overlong_penalty(lengths, max_response_length, buffer.len, buffer.penalty_factor)


def keep_varied_groups(batch: Batch) -> tuple[Batch, int, int]:
    """DAPO dynamic sampling: drop the prompts whose samples all scored the same.

    Returns (kept rows, kept prompts, prompts seen)."""
    result = algo.filter_uniform_groups(algo.group_ids_from_uids(batch["uid"]), batch["scores"])
    return batch[result.keep], result.num_kept_groups, result.num_groups


def compute_advantage(batch: Batch, cfg: AlgorithmConfig, kl_ctrl: algo.KLController) -> dict[str, float]:
    """Adds `token_level_rewards`, `advantages` and `returns` (KL in the reward when configured)."""
    mask = batch["response_mask"]
    rewards = algo.token_rewards_from_scores(batch["scores"], mask)
    metrics: dict[str, float] = {}
    if cfg.use_kl_in_reward:
        rewards, current_kl = algo.apply_kl_in_reward(
            rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, cfg.kl_penalty, kl_ctrl.value
        )
        kl_ctrl.update(current_kl, num_steps=len(batch))
        metrics |= {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_coef": kl_ctrl.value}
    inputs = algo.AdvantageInputs(token_rewards=rewards, **_advantage_columns(batch, cfg))
    advantages, returns = algo.compute_advantages(inputs, cfg)
    batch.set("token_level_rewards", rewards)
    batch.set("advantages", advantages)
    batch.set("returns", returns)
    return metrics


def rollout_is_batch_mean(batch: Batch, cfg: AlgorithmConfig) -> None:
    """With `algorithm.rollout_correction.batch_normalize`: the `[b]` column `rollout_is_batch_mean`, the whole
    batch's mean rollout-correction weight, by which the actor's loss divides every micro-batch's weights."""
    correction = algo.resolve_rollout_correction(cfg)
    if correction is None or not correction.batch_normalize:
        return
    if "rollout_log_probs" not in batch:
        raise ValueError("algorithm.rollout_correction.batch_normalize needs the rollout's log-probs in the batch")
    columns = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
    mean = algo.batch_weight_mean(*columns, correction)
    batch.set("rollout_is_batch_mean", mean.expand(len(batch)).clone())


def distill(batch: Batch, cfg: DistillationConfig) -> dict[str, float]:
    """On-policy distillation: `advantages` become `reward_coef·A − kl_coef·(log π_s − log π_T)` from the actor's
    `old_log_probs` and the teacher's `teacher_log_probs` (`megarl.algo.distill`)."""
    if "teacher_log_probs" not in batch:
        raise ValueError("algorithm.distillation is on but the batch has no teacher_log_probs (no teacher scored it)")
    advantages, metrics = distillation_advantages(
        batch["advantages"],
        batch["old_log_probs"],
        batch["teacher_log_probs"],
        batch["response_mask"],
        cfg.kl_coef,
        cfg.reward_coef,
        cfg.normalize,
    )
    batch.set("advantages", advantages)
    return metrics


def _advantage_columns(batch: Batch, cfg: AlgorithmConfig) -> dict[str, Any]:
    """The `AdvantageInputs` besides the rewards, from the batch's columns (None where absent)."""
    columns: dict[str, Any] = {
        "response_mask": batch["response_mask"],
        "group_ids": algo.group_ids_from_uids(batch["uid"]),
        **{
            key: batch[key] if key in batch else None  # noqa: SIM401 (Batch has no .get)
            for key in ("values", "baseline_scores", "old_log_probs", "sum_pi_squared", "rollout_log_probs")
        },
    }
    if "reward_components" in algo.estimator_traits(cfg.adv_estimator).needs:
        columns["reward_components"], columns["reward_weights"] = reward_components(
            list(batch["reward_extra"]), cfg.reward_weights
        )
    return columns


def shipped(batch: Batch, routing: bool) -> Batch:
    """What a role's ranks receive: the tensors, without `routed_experts` unless the role replays routings (the
    actor; the reference under R3), so the column never travels to the critic, teacher or a live-routing reference;
    and a vision-language batch's images (`multi_modal_inputs`)."""
    keys = [key for key in batch.tensor_keys if routing or key != ROUTING_COLUMN]
    images = [key for key in batch.non_tensor_keys if key == MULTI_MODAL_COLUMN]
    return batch.select(tensor_keys=keys, non_tensor_keys=images, meta_keys=[])


def balanced(batch: Batch, dp_size: int) -> tuple[Batch, torch.Tensor]:
    """Rows reordered so each of the `dp_size` consecutive shards holds about the same token count,
    and the inverse permutation that restores the original order."""
    order = torch.tensor(dp_order(batch["attention_mask"].sum(dim=1).tolist(), dp_size))
    return batch[order], torch.argsort(order)
