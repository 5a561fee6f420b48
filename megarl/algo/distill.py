"""On-policy distillation: the teacher's per-token log-probs of the student's own samples as the advantage.

For every model token t of a trajectory sampled by the student π_s, the teacher π_T scores the same token; the
per-token reverse-KL estimate k_t = log π_s(y_t) − log π_T(y_t) (its expectation over the student's samples is
KL(π_s || π_T)) enters the advantage with a minus sign, mixed with the task's advantage:

    A_t = reward_coef × A_task_t − kl_coef × k_t          (model tokens; 0 elsewhere)

as slime's `--use-opd` and Thinking Machines' on-policy distillation write it (no discount: the term is already
per token). With `normalize`, the distillation term is whitened over the batch's model tokens first
(−k_t → (−k_t − mean) / std): the mean is a baseline, and without it the samples the teacher finds nearly impossible
(k_t of 10 or more) outweigh the right ones (k_t near −2) in every gradient.
"""

from torch import Tensor

from megarl.algo.stats import masked_mean, masked_whiten


def distillation_advantages(
    task_advantages: Tensor,
    student_log_probs: Tensor,
    teacher_log_probs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    reward_coef: float,
    normalize: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """`[b, r]` advantages `reward_coef·A − kl_coef·(log π_s − log π_T)` on the mask (the second term whitened over
    the mask with `normalize`), and the step's `distill/*` metrics: the mean per-token reverse KL estimate and both
    policies' mean log-prob."""
    mask = response_mask.to(student_log_probs.dtype)
    reverse_kl = (student_log_probs - teacher_log_probs) * mask
    term = -masked_whiten(reverse_kl, mask) if normalize else -reverse_kl
    advantages = (reward_coef * task_advantages + kl_coef * term) * mask
    metrics = {
        "distill/reverse_kl": masked_mean(reverse_kl, mask).item(),
        "distill/teacher_log_prob": masked_mean(teacher_log_probs, mask).item(),
        "distill/student_log_prob": masked_mean(student_log_probs, mask).item(),
    }
    return advantages, metrics
