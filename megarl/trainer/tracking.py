"""Metric sinks chosen by `trainer.logger`, always backed by `<run_dir>/metrics.jsonl`, and a progress bar.

    tracker = Tracker(["console", "tensorboard"], run_dir, "megarl", "demo", config_dict, resume=True)
    tracker.log({"reward/score/mean": 0.4}, step=3)
    tracker.close()

metrics.jsonl holds one JSON object per logged step (`{"step": k, ...}`); it is what tests and
plots read. A resumed run first drops the lines of steps it is about to log again.
"""

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal

from megarl.config.trainer import LOGGERS

logger = logging.getLogger("megarl")

CONSOLE_PREFIXES = (
    "reward/score/mean",
    "val/reward",
    "actor/pg_loss",
    "actor/kl_loss",
    "critic/vf_loss",
    "rollout_gap/abs_diff/max",
    "response_length/mean",
    "timing/step",
)
"""Keys shown on the console line (the rest are in metrics.jsonl and the other sinks)."""


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file (empty when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tracker:
    def __init__(
        self,
        backends: list[str],
        run_dir: Path,
        project: str,
        experiment: str,
        config: dict[str, Any],
        resume: bool = False,
    ) -> None:
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {unknown}; choose from {', '.join(LOGGERS)}")
        self.backends = list(backends)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._truncate_pending = resume
        self._wandb: Any = None
        self._tensorboard: Any = None
        if "wandb" in backends:
            import wandb

            # WANDB_MODE wins when set; otherwise offline unless an API key says the user wants to sync.
            mode: Literal["online", "offline"] | None = None
            if "WANDB_MODE" not in os.environ:
                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=project, name=experiment, dir=str(self.run_dir), config=config, mode=mode)
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))

    def _truncate_from(self, step: int) -> None:
        kept = [r for r in read_metrics(self.path) if r["step"] < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def logged_steps(self) -> set[int]:
        """Steps already in metrics.jsonl."""
        return {int(r["step"]) for r in read_metrics(self.path)}

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._truncate_pending:
            self._truncate_from(step)
            self._truncate_pending = False
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        if "console" in self.backends:
            shown = [f"{k}={_fmt(v)}" for k, v in metrics.items() if k.startswith(CONSOLE_PREFIXES)]
            logger.info("step %d: %s (+%d more in %s)", step, " ".join(shown), len(metrics) - len(shown), self.path)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class ProgressBar:
    """tqdm over training steps on stderr, with the step's score and seconds."""

    def __init__(self, total_steps: int, initial_step: int, disable: bool = False) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step", disable=disable)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        score, seconds = metrics.get("reward/score/mean", float("nan")), metrics.get("timing/step", 0.0)
        self._bar.set_postfix(score=f"{score:.3f}", s=f"{seconds:.1f}")
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()
