"""Algorithm: advantage estimator, policy loss, KL handling and sampling filters, selected by name.

The names live in the registries of `megarl.algo` (formulas: docs/algorithms.md).
"""

from dataclasses import dataclass, field

from megarl.config.distill import DistillationConfig


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
class RolloutCorrectionConfig:
    """Importance weights / rejection between the rollout engine's and the trainer's π_old, around any policy
    loss (formulas: docs/algorithms.md "Rollout correction"; after verl 0.9's rollout correction)."""

    level: str = "none"
    """none (off) | token: ρ_t = π_old/π_rollout per token | sequence: ρ = Π_t ρ_t | geometric: (Π_t ρ_t)^(1/|y|)."""
    mode: str = "truncate"
    """truncate (TIS): w = clamp(ρ, lower, upper) | mask (MIS): keep tokens/sequences with lower <= ρ <= upper,
    weighted by ρ | reject: the same mask with weight 1."""
    upper: float = 2.0
    """Upper threshold on ρ."""
    lower: float | None = None
    """Lower threshold on ρ; null = none in truncate mode, 1/upper in mask/reject mode."""
    veto_threshold: float | None = None
    """A model token with π_old/π_rollout below this removes its whole sequence (e.g. 1e-4); null = off."""
    batch_normalize: bool = False
    """Divide the weights by their mean over the whole batch's kept tokens (token level) or kept sequences
    (sequence, geometric), so they average 1 (verl's rollout_is_batch_normalize)."""


@dataclass(kw_only=True, slots=True)
class PolicyLossParams:
    """Hyperparameters of the policy losses other than `ppo`/`gspo` (formulas: docs/algorithms.md).

    Defaults follow the papers or verl's `PolicyLossConfig` / actor config (v0.9.0)."""

    cispo_clip_ratio_low: float | None = None
    """cispo: the IS weight is clipped below at 1 − this; None = no lower bound (MiniMax-M1; verl's CISPO
    example sets its clip_ratio_low to 10 for the same effect)."""
    cispo_clip_ratio_high: float = 0.2
    """cispo: the IS weight is clipped above at 1 + this (verl's CISPO example)."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for tokens with A > 0 (SAPO paper / verl default)."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for tokens with A <= 0; larger = a faster-decaying gate (SAPO paper / verl)."""
    gmpo_log_clip: float = 0.4
    """gmpo: token log-ratios are clipped to ±this, i.e. ratios to (e^-0.4, e^0.4) (GMPO paper)."""
    gmpo_log_clip_low: float | None = None
    """gmpo: log-ratios are clipped below at −this; null = gmpo_log_clip (verl geo_mean's clip_ratio_low)."""
    gmpo_log_clip_high: float | None = None
    """gmpo: log-ratios are clipped above at this; null = gmpo_log_clip (verl geo_mean's clip_ratio_high)."""
    dppo_tv_delta: float = 0.15
    """dppo_tv: trust region on the sampled token's probability change |π − π_old| (verl's DPPO example)."""
    dppo_tv_delta_high: float | None = None
    """dppo_tv: the bound for tokens with A > 0 (π − π_old <= this); null = dppo_tv_delta (verl's clip_ratio_high)."""
    dppo_tv_delta_low: float | None = None
    """dppo_tv: the bound for tokens with A <= 0 (π − π_old >= −this); null = dppo_tv_delta (verl's clip_ratio_low)."""
    dppo_kl_delta: float = 0.05
    """dppo_kl: trust region on the binary KL(π_old || π) of the sampled token (verl's DPPO example)."""
    dppo_kl_delta_high: float | None = None
    """dppo_kl: the KL bound for tokens with A > 0; null = dppo_kl_delta (verl's clip_ratio_high)."""
    dppo_kl_delta_low: float | None = None
    """dppo_kl: the KL bound for tokens with A <= 0; null = dppo_kl_delta (verl's clip_ratio_low)."""
    dppo_ratio_cap: float = 20.0
    """dppo_*: the detached IS weight π/π_old is truncated at this (large, as DPPO recommends; verl's fallback)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: share of the micro-batch's model tokens whose gradient is detached (verl default)."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance in (clip_cov_lb, clip_cov_ub) are candidates (verl default)."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound of the candidates (verl default)."""
    clip_cov_seed: int = 0
    """clip_cov: seed of the random choice among candidates (same seed and batch = same tokens)."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: share of the micro-batch's model tokens, those of largest covariance, given the KL penalty."""
    kl_cov_coef: float = 0.1
    """kl_cov: weight of the |log π − log π_old| penalty on the selected tokens (verl's ppo_kl_coef)."""
    dro_beta: float | None = None
    """dro: weight of the ½(log π − log π_old)² penalty; must be set > 0 for dro (verl requires it too)."""
    bypass_is_cap: float | None = 2.0
    """bypass: detached IS weight min(ρ, cap), ρ = π/π_rollout; None = plain REINFORCE (verl's rollout_is_threshold)."""
    bypass_is_level: str = "token"
    """bypass: ρ of the token (token), of its sequence Π_t ρ_t (sequence) or their geometric mean (geometric)."""
    bypass_is_lower: float | None = None
    """bypass: IcePop. With it, tokens (sequences) whose ρ leaves [this, bypass_is_cap] get weight 0 and the others
    the untruncated ρ (verl's rollout_is_threshold "lower_upper"); null = truncate at the cap."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: gae | grpo | grpo_passk | rloo | opo | reinforce_plus_plus |
    reinforce_plus_plus_baseline | remax | gpg | gdpo (several rewards, `reward_weights`) |
    optimal_token_baseline | tir_optimal_token_baseline (multi-turn) | `package.module:function`."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """gdpo: reward component → weight. Components are numeric `RewardResult.extra` values of the reward
    function (gsm8k: acc, format_ok; arith: acc, has_number), each group-normalised alone. From the command
    line: `+algorithm.reward_weights.acc=1.0 +algorithm.reward_weights.format_ok=0.5`."""
    gamma: float = 1.0
    """Discount factor (GAE)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (false = Dr.GRPO)."""
    otb_handle_zero_tail: bool = True
    """optimal_token_baseline / tir_*: no baseline past a group's second-longest trajectory (verl's
    handle_zero_tail); false: the longest one is there its own baseline (advantage ≈ 0)."""
    policy_loss: str = "ppo"
    """ppo (clipped, dual-clip) | gspo (sequence-level ratio) | cispo (clipped detached IS weight) |
    sapo (soft sigmoid gate) | gmpo (geometric mean of token ratios) | dppo_tv | dppo_kl (divergence trust
    region) | clip_cov | kl_cov (covariance-selected tokens) | gpg (plain −A·log π) | dro (quadratic
    log-ratio penalty) | bypass (REINFORCE on the rollout log-probs) | `package.module:function`."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)."""
    clip_ratio_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_ratio_high (DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)
    """Hyperparameters of the other policy losses (cispo, sapo, gmpo, dppo_*, clip_cov, kl_cov, dro, bypass)."""
    rollout_is_cap: float | None = None
    """Truncated importance sampling against rollout log-probs, capped at this ratio; None = off. Shorthand for
    rollout_correction.level=token, mode=truncate, upper=<cap> (setting both is an error)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout correction (IS weights, rejection, veto) against the rollout engine's log-probs."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    use_kl_loss: bool = False
    """Add KL(policy || reference) to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl (k1) | abs | mse (k2) | low_var_kl (k3); straight-through kl+ (k1+) |
    abs+ | low_var_kl+ (k3+): the value of the estimator, the gradient of k2."""
    use_kl_in_reward: bool = False
    """Subtract the KL penalty from token rewards (PPO/RLHF style)."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1) | abs | mse (k2) | low_var_kl (k3) (x+ = x here: no gradient)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient controller of the in-reward KL."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO over-long reward shaping."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation: a teacher's per-token log-probs become the advantage (docs/distillation.md)."""
