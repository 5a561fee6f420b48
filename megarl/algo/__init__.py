"""The math of the trainer as pure torch functions over `[b, t]` tensors with explicit masks.

No Megatron, no Ray: the driver computes advantages and KL-shaped rewards here; the workers call
the losses on each micro-batch. Formulas and config names: docs/algorithms.md.
"""

from megarl.algo import policy_losses_cov, policy_losses_pg, policy_losses_ratio  # noqa: F401  register their losses
from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    SUPPLIED_INPUTS,
    AdvantageInputs,
    EstimatorTraits,
    compute_advantages,
    discounted_advantages,
    estimator_traits,
    group_ids_from_uids,
    register_advantage_estimator,
    token_rewards_from_scores,
)
from megarl.algo.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss, loss_normalizer
from megarl.algo.filters import GroupFilterResult, filter_uniform_groups, overlong_penalty
from megarl.algo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from megarl.algo.logits import entropy_from_logits, log_probs_from_logits
from megarl.algo.loss_params import loss_param_problems
from megarl.algo.policy_loss import POLICY_LOSSES, PolicyLossInputs, actor_loss, policy_loss
from megarl.algo.policy_losses_pg import SKIPS_OLD_LOG_PROBS
from megarl.algo.rollout_correction import (
    batch_weight_mean,
    resolve_rollout_correction,
    rollout_correction,
    rollout_correction_problems,
)
from megarl.algo.stats import group_mean_std, masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algo.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "SKIPS_OLD_LOG_PROBS",
    "SUPPLIED_INPUTS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "EstimatorTraits",
    "FixedKLController",
    "GroupFilterResult",
    "KLController",
    "LossNormalizer",
    "PolicyLossInputs",
    "actor_loss",
    "aggregate_loss",
    "apply_kl_in_reward",
    "batch_weight_mean",
    "compute_advantages",
    "discounted_advantages",
    "entropy_from_logits",
    "estimator_traits",
    "filter_uniform_groups",
    "group_ids_from_uids",
    "group_mean_std",
    "kl_penalty",
    "log_probs_from_logits",
    "loss_normalizer",
    "loss_param_problems",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "register_advantage_estimator",
    "resolve_rollout_correction",
    "rollout_correction",
    "rollout_correction_problems",
    "token_rewards_from_scores",
    "value_loss",
]
