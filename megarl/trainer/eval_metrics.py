"""Validation metrics over n samples per prompt, per data source (pure numpy, no I/O).

For each prompt with n scored samples, averaged over the prompts of a data source:

- `mean@n`: the mean score of the n samples.
- `pass@k`: the unbiased estimator of Chen et al. 2021 (Codex, arXiv:2107.03374):
  1 − C(n−c, k) / C(n, k), where c counts the samples whose score is at least the pass threshold
  (`trainer.val_pass_threshold`, 1.0 by default: the built-in rewards' score for a right answer).
  It is the chance that k samples drawn without replacement from the n include a passing one.
- `best@k` / `worst@k`: the highest / lowest score among k samples, as the mean over
  `NUM_BOOTSTRAP` draws of k samples with replacement from the n (the bootstrap).
- `maj@k`: over the same draws, the samples vote with their answer (`RewardResult.answer`); the
  answer with the most votes wins and the draw scores the mean score of that answer's drawn samples.
  Tie rule: the tied answers' scores are averaged (the expected score of a uniformly random pick).
  Samples without an answer abstain; a draw in which all abstain scores the mean of its samples.
  Reported only for data sources where some sample has an answer.

k runs over 1, 2, 4, … below n, and n itself (`sample_sizes`); best/worst/maj start at k = 2
(at k = 1 each is mean@n in expectation). The draws come from one generator seeded by `seed` and
consumed in a fixed order (sources sorted, prompts in row order), so equal inputs give equal metrics.
"""

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

NUM_BOOTSTRAP = 1000
"""Bootstrap draws of k samples per prompt and k."""

NO_ANSWER = -1
"""Answer id of a sample without an answer (it abstains from votes)."""


def sample_sizes(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two below n, then n (`6` → `[1, 2, 4, 6]`)."""
    return [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a prompt with n samples, c of them passing: 1 − C(n−c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_ids(answers: Sequence[str | None]) -> np.ndarray:
    """Equal answers get equal ids 0, 1, … in order of appearance; None gets `NO_ANSWER`. `[n]` int64."""
    ids: dict[str, int] = {}
    return np.array([NO_ANSWER if a is None else ids.setdefault(a, len(ids)) for a in answers], dtype=np.int64)


def majority_scores(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The maj@k score of each draw (see the module docstring for ties and abstentions).

    ids: `[d, k]` answer ids of the drawn samples (`NO_ANSWER` abstains); scores: `[d, k]` their scores.
    Returns `[d]`.
    """
    votes = ids[..., None] == np.arange(ids.max() + 1)  # [d, k, m]: sample j votes for answer a
    counts = votes.sum(axis=1)  # [d, m]
    sums = (votes * scores[..., None]).sum(axis=1)  # [d, m]
    top = counts.max(axis=1, initial=0, keepdims=True)  # [d, 1]
    winners = (counts == top) & (top > 0)  # [d, m]
    num_winners = winners.sum(axis=1)  # [d]
    answer_means = np.divide(sums, counts, out=np.zeros_like(sums, dtype=np.float64), where=counts > 0)
    voted = (winners * answer_means).sum(axis=1) / np.maximum(num_winners, 1)
    return np.where(num_winners > 0, voted, scores.mean(axis=1))


def bootstrap_at_k(scores: np.ndarray, ids: np.ndarray | None, k: int, rng: np.random.Generator) -> dict[str, float]:
    """best@k, worst@k and (with answer ids) maj@k of one prompt's `[n]` scores over `NUM_BOOTSTRAP` draws."""
    draws = rng.integers(0, len(scores), size=(NUM_BOOTSTRAP, k))  # [d, k] sample indices
    drawn = scores[draws]  # [d, k]
    metrics = {f"best@{k}": float(drawn.max(axis=1).mean()), f"worst@{k}": float(drawn.min(axis=1).mean())}
    if ids is not None:
        metrics[f"maj@{k}"] = float(majority_scores(ids[draws], drawn).mean())
    return metrics


def prompt_metrics(
    scores: np.ndarray, ids: np.ndarray | None, threshold: float, rng: np.random.Generator
) -> dict[str, float]:
    """mean@n, pass@k, best@k, worst@k (and maj@k with answer ids) of one prompt's `[n]` sample scores."""
    n = len(scores)
    num_passed = int((scores >= threshold).sum())
    metrics = {f"mean@{n}": float(scores.mean())}
    for k in sample_sizes(n):
        metrics[f"pass@{k}"] = pass_at_k(n, num_passed, k)
        if k > 1:
            metrics |= bootstrap_at_k(scores, ids, k, rng)
    return metrics


def source_metrics(
    prompts: list[list[int]],
    scores: np.ndarray,
    answers: Sequence[str | None],
    threshold: float,
    rng: np.random.Generator,
) -> dict[str, float]:
    """`prompt_metrics` averaged over `prompts` (each a list of row indices, all of the same length)."""
    if len({len(rows) for rows in prompts}) > 1:
        raise ValueError(f"every prompt needs the same number of samples; got {sorted({len(r) for r in prompts})}")
    with_answers = any(answers[i] is not None for rows in prompts for i in rows)
    per_prompt = [
        prompt_metrics(scores[rows], answer_ids([answers[i] for i in rows]) if with_answers else None, threshold, rng)
        for rows in prompts
    ]
    return {key: float(np.mean([m[key] for m in per_prompt])) for key in per_prompt[0]}


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[str],
    scores: Sequence[float],
    answers: Sequence[str | None],
    threshold: float,
    seed: int,
) -> dict[str, float]:
    """Per-sample rows (one prompt = one uid) → `<source>/score/mean`, `reward/score/mean` (all samples)
    and `<source>/{mean@n, pass@k, best@k, worst@k, maj@k}`; the caller adds the `val/` prefix."""
    prompts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        prompts[source][uid].append(i)
    values = np.asarray(scores, dtype=np.float64)
    rng = np.random.default_rng(seed)
    metrics = {"reward/score/mean": float(values.mean())}
    for source in sorted(prompts):
        rows = list(prompts[source].values())
        metrics[f"{source}/score/mean"] = float(values[[i for r in rows for i in r]].mean())
        metrics |= {f"{source}/{k}": v for k, v in source_metrics(rows, values, answers, threshold, rng).items()}
    return metrics
