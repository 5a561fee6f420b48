"""The console of a run: one line per step from the console sink, log lines and the progress bar never share a row."""

import io
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megarl.trainer.tracking import ProgressBar, Tracker

STEPS = [
    {"reward/score/mean": 0.25, "response_length/mean": 7.5, "rollout/finish/length": 1.0, "timing/step": 2.04},
    {"reward/score/mean": 0.5, "val/reward/score/mean": 0.625, "actor/kl_loss": 0.0123, "timing/step": 3.0},
    {"reward/score/mean": 0.75, "rollout/finish/stop": 0.75, "timing/engine_sleep": 0.25, "timing/sync": 0.5},
]
LINES = [
    "step 1: score 0.250 | len 7.5 | eos 0% | time 2.0s",
    "step 2: val 0.625 | score 0.500 | kl_loss 0.0123 | time 3.0s",
    "step 3: score 0.750 | eos 75% | hand-over 0.8s",
]


class Terminal(io.StringIO):
    """What stdout and stderr both write to when a user runs the trainer in a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def rows(self) -> list[str]:
        """The rows the terminal shows: `\\r` moves back to the row's start (then overwrites), `\\n` starts a row."""
        rows, column = [""], 0
        for part in re.split(r"(\r|\n)", self.getvalue()):
            if part == "\n":
                rows.append("")
                column = 0
            elif part == "\r":
                column = 0
            elif part:
                rows[-1] = rows[-1][:column] + part + rows[-1][column + len(part) :]
                column += len(part)
        return [row.rstrip() for row in rows if row.strip()]


@contextmanager
def _console(tty: bool) -> Iterator[tuple[Terminal, logging.StreamHandler[Terminal]]]:
    """stdout, stderr and a root logging handler as Hydra sets it up, all writing to one terminal (inside the test:
    pytest puts its own capture back on sys.stdout/sys.stderr before a test runs)."""
    terminal, streams = Terminal(tty), (sys.stdout, sys.stderr)
    handler = logging.StreamHandler(terminal)
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    megarl, level = logging.getLogger("megarl"), logging.getLogger("megarl").level
    sys.stdout = sys.stderr = terminal
    logging.getLogger().addHandler(handler)
    megarl.setLevel(logging.INFO)
    try:
        yield terminal, handler
    finally:
        sys.stdout, sys.stderr = streams
        logging.getLogger().removeHandler(handler)
        megarl.setLevel(level)


def _train(run_dir: Path) -> None:
    """What the driver does around its steps, with a log line and a worker line Ray forwards in between."""
    tracker = Tracker(["console"], run_dir, "p", "e", {})
    bar = ProgressBar(len(STEPS), 0)
    for step, metrics in enumerate(STEPS, start=1):
        if "val/reward/score/mean" in metrics:
            logging.getLogger("megarl").info("validation at step %d: score %.4f", step, 0.625)
        print("(ActorWorker pid=7) UserWarning: ", end="", file=sys.stderr)  # a line may come in pieces
        print(f"something in step {step}", file=sys.stderr)
        tracker.log(metrics, step)
        bar.update(step, metrics)
    bar.close()
    tracker.close()


def test_on_a_terminal_each_line_sits_above_the_bar(tmp_path: Path) -> None:
    with _console(tty=True) as (tty, handler):
        _train(tmp_path)
        assert (sys.stdout, sys.stderr, handler.stream) == (tty, tty, tty)  # given back
    rows = tty.rows()
    assert not [row for row in rows[:-1] if "training:" in row]  # no bar fragment in (or before) a line
    assert rows[0].startswith(f"[megarl][INFO] - metrics: {tmp_path / 'metrics.jsonl'}")
    assert rows[1:-1] == [
        "(ActorWorker pid=7) UserWarning: something in step 1",
        f"[megarl][INFO] - {LINES[0]}",
        "[megarl][INFO] - validation at step 2: score 0.6250",
        "(ActorWorker pid=7) UserWarning: something in step 2",
        f"[megarl][INFO] - {LINES[1]}",
        "(ActorWorker pid=7) UserWarning: something in step 3",
        f"[megarl][INFO] - {LINES[2]}",
    ]
    assert rows[-1].startswith("training: 100%|") and "3/3" in rows[-1]  # drawn once more below the last line


def test_into_a_pipe_there_is_no_bar_and_one_line_per_step(tmp_path: Path) -> None:
    with _console(tty=False) as (pipe, _):
        _train(tmp_path)
    assert "\r" not in pipe.getvalue() and "training" not in pipe.getvalue()
    assert [row for row in pipe.rows() if "- step" in row] == [f"[megarl][INFO] - {line}" for line in LINES]
