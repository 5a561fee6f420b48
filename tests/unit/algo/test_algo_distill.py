"""On-policy distillation's advantage (`megarl.algo.distill`) on hand-computed batches."""

import pytest
import torch

from megarl.algo.distill import distillation_advantages


def test_reverse_kl_advantage_by_hand() -> None:
    """A_t = reward_coef·A − kl_coef·(log π_s − log π_T) on model tokens, 0 on tool tokens and padding."""
    student = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-0.25, -2.0, -0.5], [-0.6, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # row 0's third token: a tool token; row 1 padded after one
    task = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    advantages, metrics = distillation_advantages(task, student, teacher, mask, kl_coef=2.0, reward_coef=0.5)
    # row 0: k = (-0.25, 1.0) → A = 0.5·1 − 2·k = (1.0, -1.5); row 1: k = 0.5 → A = 0.5·(−2) − 1 = −2.0
    assert advantages.tolist() == [[1.0, -1.5, 0.0], [-2.0, 0.0, 0.0]]
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.25 + 1.0 + 0.5) / 3)
    assert metrics["distill/teacher_log_prob"] == pytest.approx((-0.25 - 2.0 - 0.6) / 3)
    assert metrics["distill/student_log_prob"] == pytest.approx((-0.5 - 1.0 - 0.1) / 3)


def test_pure_distillation_ignores_the_task() -> None:
    student, teacher = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-3.0, -0.5]])
    advantages, _ = distillation_advantages(torch.full((1, 2), 7.0), student, teacher, torch.ones(1, 2), 1.0, 0.0)
    assert advantages.tolist() == [[-2.0, 0.5]]  # tokens the teacher finds likelier than the student get A > 0


def test_normalized_distillation_is_whitened_over_model_tokens() -> None:
    """k = (−2, 10, 4) on the model tokens: −k − mean(−k) = (6, −6, 0), unbiased std 6 → (1, −1, 0); a tool token 0."""
    student = torch.tensor([[-3.0, -1.0, -0.5], [-1.0, -2.0, -2.0]])
    teacher = torch.tensor([[-1.0, -11.0, -9.0], [-5.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages, metrics = distillation_advantages(
        torch.zeros(2, 3), student, teacher, mask, kl_coef=2.0, reward_coef=0.0, normalize=True
    )
    assert torch.allclose(advantages, torch.tensor([[2.0, -2.0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(4.0)  # the metric stays the raw estimate
