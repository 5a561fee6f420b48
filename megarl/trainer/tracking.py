"""Metric sinks chosen by `trainer.logger`, always backed by `<run_dir>/metrics.jsonl`, and a progress bar.

    tracker = Tracker(["console", "tensorboard"], run_dir, "megarl", "demo", config_dict, resume=True)
    tracker.log({"reward/score/mean": 0.4}, step=3)
    tracker.close()

metrics.jsonl holds one JSON object per logged step (`{"step": k, ...}`); it is what tests and
plots read. A resumed run first drops the lines of steps it is about to log again. The console
sink logs one line per step with the numbers a run is watched by (`console_line`).
"""

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO, cast

from megarl.config.trainer import LOGGERS

logger = logging.getLogger("megarl")

CONSOLE_FIELDS = (
    ("val", "val/reward/score/mean", "{:.3f}"),
    ("score", "reward/score/mean", "{:.3f}"),
    ("len", "response_length/mean", "{:.1f}"),
    ("eos", "rollout/finish/stop", "{:.0%}"),
    ("kl_loss", "actor/kl_loss", "{:.3g}"),
    ("reward_kl", "actor/reward_kl_penalty", "{:.3g}"),
    ("pg_loss", "actor/pg_loss", "{:.3g}"),
    ("vf_loss", "critic/vf_loss", "{:.3g}"),
    ("time", "timing/step", "{:.1f}s"),
    ("hand-over", "timing/hand_over", "{:.1f}s"),
)
"""(label, key, format) of the numbers on a step's console line, each shown when the step has it."""

HAND_OVER_KEYS = ("timing/engine_sleep", "timing/sync")
"""The seconds between rollout and training: engines release the device, then the weights reach them."""


def console_line(step: int, metrics: dict[str, float]) -> str:
    """`step 2: val 0.500 | score 0.250 | len 7.5 | eos 75% | ... | time 3.2s | hand-over 0.4s`."""
    values = dict(metrics)
    if any(key.startswith("rollout/finish/") for key in metrics):
        values.setdefault("rollout/finish/stop", 0.0)  # finish shares are logged only for reasons that occurred
    hand_over = [metrics[key] for key in HAND_OVER_KEYS if key in metrics]
    if hand_over:
        values["timing/hand_over"] = sum(hand_over)
    shown = [f"{label} {fmt.format(values[key])}" for label, key, fmt in CONSOLE_FIELDS if key in values]
    return f"step {step}: " + " | ".join(shown)


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
        if "console" in backends:
            logger.info("metrics: %s (the console shows a summary line per step)", self.path)

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
            logger.info(console_line(step, metrics))
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()

    def close(self) -> None:
        """Finish the wandb run and close the tensorboard writer; a second call does nothing."""
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._wandb = self._tensorboard = None


class ProgressBar:
    """tqdm over training steps on stderr, with the step's score and seconds; drawn only when stderr is a terminal.

    While it is drawn, stdout, stderr and the logging handlers writing to them (Hydra's console handler, Ray's)
    write whole lines above it: a log line, a worker line Ray forwards or a warning never shares a row with the
    bar. `close` gives them their streams back.
    """

    def __init__(self, total_steps: int, initial_step: int, disable: bool = False) -> None:
        from tqdm import tqdm

        self._streams = (sys.stdout, sys.stderr)
        drawn = not disable and sys.stderr.isatty()
        self._bar = tqdm(
            total=total_steps, initial=initial_step, desc="training", unit="step", file=sys.stderr, disable=not drawn
        )
        self.lock = self._bar.get_lock()
        """tqdm's own (reentrant) lock: held while the bar or a line above it is written, from any thread."""
        self._above: dict[TextIO, _AboveBar] = {}
        self._handlers: dict[logging.StreamHandler[TextIO], TextIO] = {}
        if drawn:
            self._redirect()

    def _redirect(self) -> None:
        self._above = {stream: _AboveBar(stream, self) for stream in self._streams}
        sys.stdout, sys.stderr = (cast(TextIO, self._above[stream]) for stream in self._streams)
        for handler in _console_handlers(self._streams):
            self._handlers[handler] = handler.stream
            handler.setStream(cast(TextIO, self._above[handler.stream]))

    def write_above(self, stream: TextIO, lines: str) -> None:
        """Clear the bar, write `lines` (each ending in a newline) to `stream`, draw the bar again below them."""
        with self.lock:
            self._bar.clear(nolock=True)
            self._bar.fp.flush()  # the clearing reaches the terminal before the lines do
            stream.write(lines)
            stream.flush()
            self._bar.refresh(nolock=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        score, seconds = metrics.get("reward/score/mean", float("nan")), metrics.get("timing/step", 0.0)
        self._bar.set_postfix(score=f"{score:.3f}", s=f"{seconds:.1f}", refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._above:
            sys.stdout, sys.stderr = self._streams
        for handler, stream in self._handlers.items():
            handler.setStream(stream)
        self._bar.close()
        for above in self._above.values():
            above.stream.write(above.partial)


class _AboveBar:
    """Stands in for stdout or stderr while the bar is drawn: whole lines go above the bar, a partial one waits."""

    def __init__(self, stream: TextIO, bar: ProgressBar) -> None:
        self.stream = stream
        self.partial = ""
        self._bar = bar

    def write(self, text: str) -> int:
        with self._bar.lock:
            lines, newline, self.partial = (self.partial + text).rpartition("\n")
            if newline:
                self._bar.write_above(self.stream, lines + newline)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


def _console_handlers(streams: tuple[TextIO, ...]) -> list[logging.StreamHandler[TextIO]]:
    """The logging handlers, on any logger, that write to one of `streams`."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {handler for log in loggers if isinstance(log, logging.Logger) for handler in log.handlers}
    return [h for h in handlers if isinstance(h, logging.StreamHandler) and h.stream in streams]
