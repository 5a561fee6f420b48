"""Algorithm: advantage estimator, policy loss, KL handling and sampling filters, selected by name.

The names live in the registries of `megarl.algo` (formulas: docs/algorithms.md).
"""

from dataclasses import dataclass, field


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
    """Per-trajectory value compared within a group (score: the trajectory's reward, before shaping)."""
    max_num_gen_batches: int = 0
    """Generation rounds per step before giving up; 0 = unbounded."""


@dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO over-long shaping: penalise responses that run into the last `len` tokens of the budget."""
    len: int = 512
    """Buffer length B: the penalty grows linearly from 0 at max_response_length − B to the full factor."""
    penalty_factor: float = 1.0
    """Penalty at max_response_length (subtracted from the score)."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: gae | grpo | grpo_passk | rloo | opo | reinforce_plus_plus |
    reinforce_plus_plus_baseline | remax | `package.module:function`."""
    gamma: float = 1.0
    """Discount factor (GAE)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (false = Dr.GRPO)."""
    policy_loss: str = "ppo"
    """ppo (clipped, dual-clip) | gspo (sequence-level ratio) | `package.module:function`."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)."""
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
    """KL estimator for the loss: kl (k1) | abs | mse (k2) | low_var_kl (k3)."""
    use_kl_in_reward: bool = False
    """Subtract the KL penalty from token rewards (PPO/RLHF style)."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1) | abs | mse (k2) | low_var_kl (k3)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient controller of the in-reward KL."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO over-long reward shaping."""
