"""`metrics.png`: key metrics over steps, one panel each."""

import os
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PLOT_KEYS = (
    "val/reward/score/mean",
    "reward/score/mean",
    "rollout/finish/stop",
    "rollout/response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "critic/vf_loss",
    "val/loss",
    "actor/loss",
    "distill/reverse_kl",
    "rollout_gap/abs_diff/max",
    "timing/step",
)


def plot_metrics(metrics: list[dict[str, float]], out_png: Path, keys: Sequence[str]) -> Path:
    """One panel per key present in `metrics` (x = step); written atomically to `out_png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(k in r for r in metrics)]
    if not present:
        raise ValueError(f"none of {list(keys)} is in the metrics; nothing to plot")
    cols = min(3, len(present))
    rows = -(-len(present) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present, strict=False):
        points = [(r["step"], r[key]) for r in metrics if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 20 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png
