"""Write `summary.md` of a device check from what its steps left in the output folder; exit 1 unless every
step passed. Standard library only: it runs even when the install step failed.

    python3 tests/gpu/check_summary.py STEPS_TSV OUT_DIR WHERE
"""

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

E2E_KEYS = (
    "handover/",
    "offload/",
    "sync/",
    "timing/step",
    "timing/gen",
    "timing/update_actor",
    "timing/save_checkpoint",
    "rollout_gap/abs_diff/max",
    "reward/score/mean",
    "perf/tokens_per_s",
)
"""Prefixes of the e2e metrics the summary shows: hand-over memory and timings, the step's phases, the
rollout-vs-trainer log-prob gap."""


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_table(steps_tsv: Path) -> tuple[list[str], bool]:
    rows = [line.split("\t") for line in steps_tsv.read_text().splitlines() if line.strip()]
    table = ["| step | result | seconds |", "|---|---|---|"]
    table += [f"| {name} | {result} | {seconds} |" for name, result, seconds in rows]
    return table, bool(rows) and all(result == "ok" for _, result, _ in rows)


def junit_line(path: Path) -> list[str]:
    if not path.exists():
        return []
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return [
        f"tests/gpu: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped ({float(suite.get('time', 0)):.0f} s)"
    ]


def report_table(path: Path) -> list[str]:
    records = _lines(path)
    if not records:
        return []
    table = ["", "| test | device | numbers |", "|---|---|---|"]
    for record in records:
        numbers = ", ".join(f"{k} {_number(v)}" for k, v in record.items() if k not in ("test", "device"))
        table.append(f"| {record['test']} | {record['device']} | {numbers} |")
    return table


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def e2e_table(path: Path) -> list[str]:
    steps = _lines(path)
    if not steps:
        return []
    keys = sorted({k for step in steps for k in step if k.startswith(E2E_KEYS)})
    table = ["", "| e2e metric | " + " | ".join(f"step {s.get('step', i + 1)}" for i, s in enumerate(steps)) + " |"]
    table.append("|---|" + "---|" * len(steps))
    for key in keys:
        table.append(f"| {key} | " + " | ".join(_number(step.get(key, "")) for step in steps) + " |")
    return table


def bench_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    figures = json.loads(path.read_text())
    lines = [
        "",
        f"sync bench: {figures['bytes'] / 1e9:.2f} GB, copy floor {figures['copy_floor_s'] * 1e3:.1f} ms "
        f"({figures['bytes'] / 1e9 / figures['copy_floor_s']:.0f} GB/s) on {figures['device']}; "
        f"broadcast over {figures['broadcast_backend']}",
    ]
    for kind in ("tensor", "tensor/1h", "broadcast"):
        f = figures[kind]
        lines.append(
            f"- {kind}: sync {f['sync_s']:.3f} s = {f['sync_over_copy_floor']:.3f} of the copy floor, "
            f"{f['sync_over_transport_floor']:.2f} of its transport floor; max |Δ log-prob| {f['max_log_prob_gap']:.1e}"
        )
    return lines


def main() -> None:
    steps_tsv, out, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    table, passed = steps_table(steps_tsv)
    lines = [f"# megarl device check ({where}): {'every step passed' if passed else 'NOT every step passed'}", ""]
    lines += [*table, "", *junit_line(out / "junit.xml")]
    lines += report_table(out / "report.jsonl") + e2e_table(out / "e2e_metrics.jsonl") + bench_lines(out / "bench.json")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
