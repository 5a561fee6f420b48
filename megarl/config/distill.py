"""On-policy distillation (`algorithm.distillation`): a teacher scores every token the student sampled.

The per-token reverse KL estimate `log π_student − log π_teacher` of each sampled token becomes a (negative)
advantage, optionally mixed with the task's advantage (formulas: docs/distillation.md). The teacher is a frozen
Megatron role (`backend=megatron`: its own checkpoint and layout on the trainer's devices, any shipped family) or
engines of its own that prefill prompt + response and return input log-probs (`backend=engine`).
"""

from dataclasses import dataclass, field

from megarl.config.reward import RetryConfig, RewardEnginesConfig
from megarl.config.training import MegatronConfig

TEACHER_BACKENDS = ("megatron", "engine")


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    path: str | None = None
    """The teacher's HF checkpoint directory (a causal LM of a shipped family; may be larger than the student)."""
    tokenizer_path: str | None = None
    """The teacher's tokenizer; None = `path`'s. It must equal the student's (distillation compares per-token
    log-probs): a different vocabulary is refused before anything starts."""
    backend: str = "megatron"
    """megatron (a frozen Megatron role on the trainer's devices, forward only; scores a step's trajectories after
    rollout) | engine (engine replicas of their own, `engines`; score each trajectory as it finishes)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """backend=megatron: the teacher's layout (TP/PP/EP; DP = the rest of the trainer's devices)."""
    log_prob_micro_batch_size_per_device: int | None = None
    """backend=megatron: trajectories per forward; None = actor.log_prob_micro_batch_size_per_device."""
    offload: bool = False
    """backend=megatron, colocated: hold the teacher's weights in host memory except while it scores."""
    engines: RewardEnginesConfig = field(default_factory=RewardEnginesConfig)
    """backend=engine: the replicas' pool (devices of their own, or `urls` of servers already running)."""
    concurrency: int = 32
    """backend=engine: prefill requests in flight per agent worker."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """backend=engine: each request's timeout and retries; a trajectory the teacher cannot score fails the step."""


@dataclass(kw_only=True, slots=True)
class DistillationConfig:
    enable: bool = False
    """Distil from `teacher` on the student's own samples."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Who scores the sampled tokens."""
    kl_coef: float = 1.0
    """Weight of the reverse-KL term: A_t = reward_coef × A_task_t − kl_coef × (log π_s − log π_t)."""
    reward_coef: float = 0.0
    """Weight of the task advantage (the advantage estimator's, from the rewards); 0 = pure distillation."""
    normalize: bool = False
    """Whiten the distillation term over the batch's model tokens (its mean a baseline): samples the teacher finds
    nearly impossible then no longer outweigh the rest (docs/sft_distillation.md)."""


def distillation_problems(d: DistillationConfig) -> list[str]:
    """The settings' own checks (files and tokenizers: `megarl.plan.distill`)."""
    if not d.enable:
        return []
    t = d.teacher
    problems = []
    if t.path is None:
        problems.append("algorithm.distillation.enable=true needs algorithm.distillation.teacher.path (HF checkpoint)")
    if t.backend not in TEACHER_BACKENDS:
        problems.append(
            f"algorithm.distillation.teacher.backend={t.backend!r} is unknown; choose one of "
            + ", ".join(TEACHER_BACKENDS)
        )
    if d.kl_coef <= 0 or d.reward_coef < 0:
        problems.append(
            f"algorithm.distillation.kl_coef={d.kl_coef} must be > 0 (else nothing of the teacher is used) and "
            f"reward_coef={d.reward_coef} >= 0"
        )
    return problems
