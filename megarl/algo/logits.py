"""Token log-probabilities and entropy from logits `[..., v]` (computed in float32)."""

import torch
from torch import Tensor


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[label] `[...]`; the temperature must match the rollout's sampling."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)
    return picked - scaled.logsumexp(dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z with z = logits / temperature, `[...]`."""
    scaled = logits.float() / temperature
    return scaled.logsumexp(dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
