"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. The log-softmax needs only
three cross-rank reductions per token (max, Σexp, the target's logit), and entropy one more
(Σ p·z), so no rank ever materialises the full-vocabulary row. Tokens are processed in chunks
of `chunk_tokens`; with autograd on, each chunk is recomputed in backward instead of keeping
its fp32 softmax, which bounds memory at one chunk × V/TP.
"""

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint


def _chunk_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
    weighted = reduce_from_tensor_model_parallel_region((exp * finite).sum(dim=-1), group)
    entropy = log_z - weighted / sum_exp
    return log_probs, entropy


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(label) and entropy `[...]` from `logits [..., V_pad/TP]` split over `group`.

    `vocab_size` is the true vocabulary: padding columns are excluded. Entropy is zeros unless
    `with_entropy`. Temperature divides the logits, as the rollout engine sampled with it.
    """
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
            with_entropy,
        )
        if torch.is_grad_enabled() and flat_logits.requires_grad:
            outputs.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            outputs.append(_chunk_stats(*args))
    log_probs = torch.cat([o[0] for o in outputs]).reshape(shape)
    entropy = torch.cat([o[1] for o in outputs]).reshape(shape)
    return log_probs, entropy
