"""Memory creep over a long run (issue 41): the CPU demo (`configs/demo_cpu.yaml`: GRPO, TP=2, colocated, two
embedded engines, from the SFT warm-up in runs/warmup/tiny_dense_largest, or `model=tiny_dense` without it) run for
`--steps` steps with validation and checkpoints, every process of the run sampled after each logged step
(`bench/soak_probe.py`: PSS, anonymous PSS, open files, threads, Ray objects owned; the object store;
`/dev/shm`), then per process: its memory after warm-up (`--warmup`, step 50) and at the end, and its growth per
100 steps after warm-up (the slope of a least-squares line), open files and threads the same. Rows beyond the
issue's goal (1% or 20 MB per 100 steps) are flagged. The table (markdown) goes to stdout and
`<run_dir>/soak_table.md`, the samples to `<run_dir>/soak_samples.jsonl`.

    .venv/bin/python bench/soak.py [--steps 300] [--test-freq 20] [--save-freq 50] [--device cuda] [overrides ...]

`--device cuda` sets `trainer.device=cuda trainer.devices_per_node=<--gpus> actor.megatron.tensor_model_parallel_size
=min(2, gpus)` (the demo's config has no CUDA switch of its own) and samples each process's GPU memory with
nvidia-smi. The trainer reports no `torch.cuda.memory_allocated/reserved` per rank or engine each step; the only
device-memory metrics in metrics.jsonl, `handover/*reserved_{before,after}_bytes` (the actor's and reference's
allocator reserve around each hand-over), are tabled as `metric ...` rows.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_probe import Probe, Record

REPO = Path(__file__).resolve().parents[1]
WARMUP_MODEL = REPO / "runs/warmup/tiny_dense_largest/config.json"
DEMO_DATA = REPO / "data/processed/largest"
GOAL_FRACTION = 0.01
GOAL_BYTES = 20 * 2**20
"""The issue's goal: after warm-up no process grows more than 1% (or 20 MB) per 100 steps."""
MB = 2**20
MIN_SAMPLES = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--test-freq", type=int, default=20, help="validation every this many steps")
    parser.add_argument("--save-freq", type=int, default=50, help="a checkpoint every this many steps")
    parser.add_argument("--warmup", type=int, default=50, help="growth is fitted from this step on")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpus", type=int, default=1, help="--device cuda: GPUs of the machine to use")
    parser.add_argument("--run-dir", type=Path, help="default runs/soak/<device>-<steps>-<time>")
    parser.add_argument("overrides", nargs="*", help="extra megarl-train overrides")
    return parser.parse_args()


def train_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The demo's config, run for `--steps` with validation and checkpoints, from the warm-up if it exists."""
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"trainer.save_freq={args.save_freq}",
        "trainer.resume_mode=disable",
        "trainer.progress_bar=false",
    ]
    if not WARMUP_MODEL.is_file():
        overrides.append("model=tiny_dense")  # the random-init model: the same processes and memory behaviour
    if not (DEMO_DATA / "train.parquet").is_file() or not (DEMO_DATA / "test.parquet").is_file():
        overrides += write_data(run_dir / "data")
    if args.device == "cuda":
        tp = min(2, args.gpus)
        devices = f"trainer.devices_per_node={args.gpus}"
        overrides += ["trainer.device=cuda", devices, f"actor.megatron.tensor_model_parallel_size={tp}"]
    return [*overrides, *args.overrides]


def write_data(data: Path) -> list[str]:
    """The demo's task data (as launch/demo_cpu.sh writes it) under `data`; the overrides that point at it."""
    exe = Path(sys.executable).with_name("megarl-preprocess")
    splits = {"train": ("2048", "0"), "test": ("128", "1")}
    for split, (rows, seed) in splits.items():
        out = data / f"{split}.parquet"
        command = [str(exe), "largest", "--output", str(out), "--num-rows", rows, "--seed", seed, "--split", split]
        subprocess.run(command, check=True)
    return [f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/test.parquet]"]


class MetricsTail:
    """The newest step logged in a growing metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.step: int | None = None

    def poll(self) -> int | None:
        """The newest step, read from the lines appended since the last poll (complete lines only)."""
        if not self.path.is_file():
            return self.step
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                self.step = int(json.loads(line)["step"])
        return self.step


def soak(command: list[str], run_dir: Path, cuda: bool) -> tuple[list[Record], int]:
    """Run `command`, sampling its processes once per newly logged step; the samples and its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["RAY_AUTH_MODE"] = "disabled"  # the run's local cluster answers the sampler's node-stats call without a token
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    probe = Probe(proc.pid, cuda)
    tail = MetricsTail(run_dir / "metrics.jsonl")
    records: list[Record] = []
    sampled = None
    with (run_dir / "soak_samples.jsonl").open("w") as out:
        while proc.poll() is None:
            step = tail.poll()
            if step is None or step == sampled:
                time.sleep(0.25)
                continue
            sampled = step
            batch = probe.sample(step)
            records += batch
            out.write("".join(json.dumps(r) + "\n" for r in batch))
            out.flush()
    return records, proc.wait()


def metric_records(run_dir: Path) -> list[Record]:
    """The run's own memory metrics (`handover/*bytes`, any key naming memory) as `metric <key>` records."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if (key.startswith("handover/") or "memory" in key) and value:  # 0 without CUDA
                records.append({"step": int(row["step"]), "kind": f"metric {key}", "mem": value})
    return records


def labelled(records: list[Record]) -> dict[str, list[Record]]:
    """Records by row: a kind with one process (or none: the store, `/dev/shm`) is its row, else `<kind> #i`
    per pid in order of first appearance (a restarted process is a new row)."""
    pids: dict[str, list[int]] = defaultdict(list)
    for r in records:
        if "pid" in r and r["pid"] not in pids[r["kind"]]:
            pids[r["kind"]].append(r["pid"])
    rows: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r["kind"] == "sampler":
            continue
        of_kind = pids[r["kind"]]
        label = r["kind"] if len(of_kind) <= 1 else f"{r['kind']} #{of_kind.index(r['pid'])}"
        rows[label].append(r)
    return dict(rows)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two distinct x)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def trend(samples: list[Record], field: str) -> tuple[float, float, float] | None:
    """(value at warm-up, value at the end, growth per 100 steps) of `field`; None where no sample has it."""
    points = [(float(r["step"]), float(r[field])) for r in samples if field in r]
    if not points:
        return None
    return points[0][1], points[-1][1], 100 * slope(points)


def flag(mem: tuple[float, float, float]) -> str:
    """Which of the goal's bounds the growth passes: "1%", "20MB", both ("FAIL"), or none ("")."""
    start, _, growth = mem
    over_fraction = start >= MB and growth > GOAL_FRACTION * start  # no percentages of a near-empty store
    over_bytes = growth > GOAL_BYTES
    if over_fraction and over_bytes:
        return "FAIL"
    return "1%" if over_fraction else "20MB" if over_bytes else ""


def count_cell(values: tuple[float, float, float] | None) -> str:
    """`start→end (+growth/100)` for a count; empty where absent."""
    if values is None:
        return ""
    start, end, growth = values
    return f"{start:.0f}→{end:.0f} ({growth:+.1f})"


def row(label: str, samples: list[Record]) -> str | None:
    """One markdown table row for a process (or the store, `/dev/shm`, a metric); None without memory samples."""
    mem = trend(samples, "mem")
    if mem is None:
        return None
    start, end, growth = mem
    pct = f"{growth / start:+.2%}" if start >= MB else ""
    pids = sorted({r["pid"] for r in samples if "pid" in r})
    anon = trend(samples, "anon")
    anon_cell = f"{anon[2] / MB:+.2f}" if anon else ""
    counts = [count_cell(trend(samples, f)) for f in ("fds", "threads", "objects")]
    cells = [label, ",".join(map(str, pids)), f"{start / MB:.1f}", f"{end / MB:.1f}", f"{growth / MB:+.2f}", pct]
    return "| " + " | ".join([*cells, anon_cell, *counts, flag(mem)]) + " |"


HEADER = (
    "| process | pid | MB at warm-up | MB at end | MB / 100 steps | % / 100 steps | anon MB / 100 | "
    "open files (/100) | threads (/100) | Ray objects (/100) | goal |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def table(records: list[Record], warmup: int) -> str:
    """The markdown table of every row's trend from step `warmup` on; rows sampled fewer than `MIN_SAMPLES` times
    (a checkpoint's writer processes) are counted below it."""
    after = [r for r in records if r["step"] >= warmup]
    rows = labelled(after)
    kept = {label: samples for label, samples in rows.items() if len(samples) >= MIN_SAMPLES}
    lines = [row(label, samples) for label, samples in sorted(kept.items())]
    short = f"\n{len(rows) - len(kept)} short-lived processes (under {MIN_SAMPLES} samples) left out."
    return "\n".join([HEADER, *[line for line in lines if line]]) + short


def tasks_per_step(records: list[Record]) -> float:
    """Ray tasks (actor calls) all workers ran per step: the slope of their sum, each of which the GCS keeps an
    event of (up to Ray's `task_events_max_num_task_in_gcs`)."""
    totals: dict[int, int] = defaultdict(int)
    for r in records:
        totals[r["step"]] += r.get("tasks", 0)
    return slope([(float(step), float(total)) for step, total in totals.items() if total])


def summary(records: list[Record], run_dir: Path, wall_s: float, warmup: int) -> str:
    """What the table covers: steps, wall time, step time, the sampler's own cost, what MB means per row."""
    steps = sorted({r["step"] for r in records if r["kind"] == "sampler"})
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [m["timing/step"] for m in metrics if "timing/step" in m]
    sampler = [r["seconds"] for r in records if r["kind"] == "sampler"]
    return (
        f"soak: {len(steps)} samples, steps {steps[0]}..{steps[-1]}, growth fitted from step {warmup}; "
        f"wall {wall_s:.0f} s, mean step {sum(step_s) / len(step_s):.2f} s, "
        f"sampling {sum(sampler) / len(sampler):.2f} s per sample; Ray tasks {tasks_per_step(records):.1f} per step.\n"
        "MB: PSS for a process, plus its forks' (which have rows of their own too; anon: the anonymous part of it, "
        "heap and tensors, without the mapped files), bytes used for the object store, "
        "file bytes for /dev/shm (run: the files the run's processes hold open or mapped; machine: all of it, other "
        "users' too), the value for a metric. "
        "Counts: open files (/dev/shm: files), threads, Ray objects owned (store: objects held). "
        "goal: growth per 100 steps over 1% of the warm-up value, over 20 MB, or both (FAIL)."
    )


def main() -> None:
    args = parse_args()
    run_dir = (args.run_dir or REPO / f"runs/soak/{args.device}-{args.steps}-{time.strftime('%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    train = Path(sys.executable).with_name("megarl-train")
    command = [str(train), "--config-name", "demo_cpu", *train_overrides(args, run_dir)]
    print("soak:", " ".join(command), flush=True)
    start = time.monotonic()
    records, status = soak(command, run_dir, args.device == "cuda")
    wall_s = time.monotonic() - start
    records += metric_records(run_dir)
    warmup = min(args.warmup, args.steps // 2)
    report = summary(records, run_dir, wall_s, warmup) + "\n\n" + table(records, warmup) + "\n"
    (run_dir / "soak_table.md").write_text(report)
    print(report)
    if status:
        sys.exit(f"soak: megarl-train exited with {status} (the table covers the steps it logged)")


if __name__ == "__main__":
    main()
