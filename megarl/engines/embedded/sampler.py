"""Next-token choice for a batch of sequences with their own sampling parameters."""

from dataclasses import dataclass

import torch

from megarl.engines.client.sglang_api import GREEDY_TEMPERATURE


@dataclass(kw_only=True, slots=True)
class RowSampling:
    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    """A seeded request's own RNG, so its samples do not depend on what it was batched with;
    None = the engine's shared RNG."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def sample(logits: torch.Tensor, rows: list[RowSampling], shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b] and the log-probs [b, v] of every vocabulary id for `logits` [b, v] (fp32, on the CPU).

    The log-probs are log_softmax(logits / temperature) before top-k/top-p truncation, the quantity
    the trainer recomputes (temperature 1 for greedy rows). Sampling is an exponential race,
    argmax(p / E) with E ~ Exp(1) i.i.d., which draws exactly from p with one noise vector per row.
    """
    temps = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)  # [b, v]
    tokens = logprobs.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        index = torch.tensor(sampled)
        probs = _truncated_probs(logprobs[index], [rows[i] for i in sampled])  # [s, v]
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=shared)
        for j, i in enumerate(sampled):
            if (generator := rows[i].generator) is not None:
                noise[j].exponential_(generator=generator)
        tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs


def _truncated_probs(logprobs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Probabilities [n, v], renormalised over each row's top-k ∩ top-p set (sorting only rows that truncate)."""
    probs = logprobs.exp()
    vocab = logprobs.shape[-1]
    truncated = [j for j, r in enumerate(rows) if r.top_p < 1.0 or 0 < r.top_k < vocab]
    if not truncated:
        return probs
    index = torch.tensor(truncated)
    sorted_probs, order = probs[index].sort(dim=-1, descending=True)
    ks = torch.tensor([rows[j].top_k if 0 < rows[j].top_k < vocab else vocab for j in truncated])
    ps = torch.tensor([rows[j].top_p for j in truncated], dtype=probs.dtype)
    rank = torch.arange(vocab)[None, :]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < ks[:, None]) & (mass_before < ps[:, None])
    kept = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs * keep)
    probs[index] = kept / kept.sum(dim=-1, keepdim=True)
    return probs
