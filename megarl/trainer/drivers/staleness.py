"""Weight versions of trained samples: staleness, version spans and their per-step metrics.

Every model token of a rollout carries the number of the weight version that generated it
(`rollout_versions [b, r]`, -1 on tool/user tokens and padding). The trainer's current version at
step s is s − 1 (the updates done so far). A sample's staleness is the current version minus the
version of its oldest model token; its span is newest minus oldest (> 0: a partial rollout crossed a
weight update). A sample without model tokens has staleness 0 and span 0.
"""

import torch

NO_VERSION = -1
"""`rollout_versions` of a position no model sampled."""
HISTOGRAM_BINS = 4
"""Staleness 0 … HISTOGRAM_BINS − 2 get a bin each; the last bin counts everything older."""


def oldest_versions(versions: torch.Tensor, current: int) -> torch.Tensor:
    """[b] the version of each row's oldest model token (`current` for a row without one)."""
    sampled = versions != NO_VERSION
    return torch.where(sampled, versions, current).amin(dim=1)


def staleness(versions: torch.Tensor, current: int) -> torch.Tensor:
    """[b] current − oldest version, ≥ 0."""
    return current - oldest_versions(versions, current)


def version_span(versions: torch.Tensor) -> torch.Tensor:
    """[b] newest − oldest version over each row's model tokens (0 without any)."""
    sampled = versions != NO_VERSION
    newest = torch.where(sampled, versions, torch.iinfo(versions.dtype).min).amax(dim=1)
    oldest = torch.where(sampled, versions, torch.iinfo(versions.dtype).max).amin(dim=1)
    return torch.where(sampled.any(dim=1), newest - oldest, 0)


def staleness_metrics(versions: torch.Tensor, current: int, ages: torch.Tensor | None = None) -> dict[str, float]:
    """`async/staleness/{mean,max,hist_<k>}` (shares of samples) and `async/version_span/{mean,max}`; `ages`: the
    rows' `staleness(versions, current)` when the caller has it already (`Group.age_at`), not computed again."""
    ages = (staleness(versions, current) if ages is None else ages).float()
    spans = version_span(versions).float()
    metrics = {
        "async/staleness/mean": ages.mean().item(),
        "async/staleness/max": ages.max().item(),
        "async/version_span/mean": spans.mean().item(),
        "async/version_span/max": spans.max().item(),
        "async/multi_version_frac": (spans > 0).float().mean().item(),
    }
    binned = ages.clamp(max=HISTOGRAM_BINS - 1).long()
    counts = torch.bincount(binned, minlength=HISTOGRAM_BINS).float() / len(ages)
    last = f"{HISTOGRAM_BINS - 1}+"
    metrics |= {f"async/staleness/hist_{k if k < HISTOGRAM_BINS - 1 else last}": c.item() for k, c in enumerate(counts)}
    return metrics
