"""Algorithm: advantage estimator, policy loss, KL handling and sampling filters, selected by name."""

from dataclasses import dataclass, field

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
)
"""Built-in advantage estimators; a name containing a dot is a user function's import path."""
GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline")
"""Estimators that compare the rollout.n samples of one prompt (need n >= 2)."""
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass(kw_only=True, slots=True)
class KLControlConfig:
    type: str = "fixed"
    """fixed | adaptive coefficient of the KL penalty in the reward."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient."""
    target_kl: float = 0.1
    """adaptive: the KL the controller steers toward."""
    horizon: int = 10000
    """adaptive: steps over which the coefficient adapts."""


@dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal, generate more until full."""
    metric: str = "score"
    """Per-trajectory value compared within a group."""
    max_num_gen_batches: int = 0
    """Generation rounds per step before giving up; 0 = unbounded."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: one of ADV_ESTIMATORS or `package.module:function`."""
    gamma: float = 1.0
    """Discount factor (GAE)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (false = Dr.GRPO)."""
    policy_loss: str = "ppo"
    """ppo (clipped, dual-clip) | gspo (sequence-level ratio) | `package.module:function`."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number: one of LOSS_AGG_MODES."""
    clip_ratio_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_ratio_high (DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    rollout_is_cap: float | None = None
    """Truncated importance sampling against rollout log-probs, capped at this ratio; None = off."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    use_kl_loss: bool = False
    """Add KL(policy || reference) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: one of KL_PENALTIES."""
    use_kl_in_reward: bool = False
    """Subtract the KL penalty from token rewards (PPO/RLHF style)."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: one of KL_PENALTIES."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient controller of the in-reward KL."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
