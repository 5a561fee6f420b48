"""Per-token log-probs, entropy and Σπ² from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. The log-softmax needs only
three cross-rank reductions per token (max, Σexp, the target's logit), entropy one more (Σ p·z)
and Σ_v π(v)² one more (Σ exp(2z)), so no rank ever materialises the full-vocabulary row. Tokens are processed in chunks
of `chunk_tokens`; with autograd on, each chunk is recomputed in backward instead of keeping
its fp32 softmax, which bounds memory at one chunk × V/TP.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

EXTRAS = ("entropy", "sum_pi_squared")
"""Per-token statistics besides the log-prob that a forward pass can return."""


class TokenStats(NamedTuple):
    log_probs: torch.Tensor
    """log π(label)."""
    entropy: torch.Tensor
    """−Σ_v π(v)·log π(v); zeros unless asked for."""
    sum_pi_squared: torch.Tensor
    """Σ_v π(v)² (the optimal token baseline's logit-gradient norm); zeros unless asked for."""


def _chunk_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = logits.float() / temperature  # [n, v/tp]
    local_vocab = z.shape[-1]
    pad = vocab_start + local_vocab - vocab_size
    if pad > 0:  # this rank's slice ends in padding rows, which are not tokens
        keep = torch.arange(local_vocab, device=z.device) < local_vocab - pad
        z = z.masked_fill(~keep, float("-inf"))
    local_max = z.detach().max(dim=-1).values  # [n]
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = z - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), group)
    log_z = sum_exp.log()  # [n], log Σ exp(z − max)
    local_label = labels - vocab_start
    in_slice = (local_label >= 0) & (local_label < local_vocab)
    picked = shifted.gather(-1, local_label.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target = reduce_from_tensor_model_parallel_region(picked.masked_fill(~in_slice, 0.0), group)
    log_probs = target - log_z
    entropy = sum_pi_squared = torch.zeros_like(log_probs)
    if with_entropy:
        finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
        weighted = reduce_from_tensor_model_parallel_region((exp * finite).sum(dim=-1), group)
        entropy = log_z - weighted / sum_exp
    if with_sum_pi_squared:  # Σ (e^z / Σe^z)² = Σ e^{2z} / (Σ e^z)², both sums over all ranks
        sum_pi_squared = reduce_from_tensor_model_parallel_region(exp.square().sum(dim=-1), group) / sum_exp.square()
    return log_probs, entropy, sum_pi_squared


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_size: int,
    temperature: float = 1.0,
    extras: tuple[str, ...] = (),
    chunk_tokens: int = 4096,
) -> TokenStats:
    """log π(label) and the `extras` (names in `EXTRAS`) `[...]` from `logits [..., V_pad/TP]` split over `group`.

    `vocab_size` is the true vocabulary: padding columns are excluded. Statistics not in `extras` are
    zeros. Temperature divides the logits, as the rollout engine sampled with it.
    """
    unknown = set(extras) - set(EXTRAS)
    if unknown:
        raise ValueError(f"unknown per-token statistics {sorted(unknown)}; choose from {EXTRAS}")
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    vocab_start = group.rank() * logits.shape[-1]
    outputs = []
    for start in range(0, flat_labels.numel(), chunk_tokens):
        args = (
            flat_logits[start : start + chunk_tokens],
            flat_labels[start : start + chunk_tokens],
            group,
            vocab_start,
            vocab_size,
            temperature,
            "entropy" in extras,
            "sum_pi_squared" in extras,
        )
        if torch.is_grad_enabled() and flat_logits.requires_grad:
            outputs.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            outputs.append(_chunk_stats(*args))
    return TokenStats(*(torch.cat([o[i] for o in outputs]).reshape(shape) for i in range(3)))
