"""One sample of every process of a megarl-train run, for `bench/soak.py`: memory (PSS, anonymous PSS, USS,
RSS), open files and threads per process, named by what it is (its Ray actor class, or its command line); the Ray
object store (the raylet's node stats over gRPC: bytes used, objects; and per worker pid the objects it owns); the
`/dev/shm` files the run's processes hold open or mapped, and the machine's `/dev/shm` total; on CUDA, each
process's GPU memory (nvidia-smi).

    probe = Probe(driver_pid, cuda=False)
    records = probe.sample(step=12)   # [{"step": 12, "kind": "actor rank", "pid": 4242, "mem": ..., ...}, ...]

A record's `mem` is bytes (for a process its PSS plus its forks' PSS: `fold_forks`), `fds` open files (files for
`/dev/shm`), `threads` threads, `objects` Ray objects (owned by the process, or held by the store) and `tasks` the
Ray tasks a worker ran so far; a field a record has no value for is absent.
"""

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import psutil

RAY_CLASSES = {
    "ActorWorker": "actor rank",
    "ReferenceWorker": "ref rank",
    "CriticWorker": "critic rank",
    "RewardModelWorker": "reward model rank",
    "TeacherWorker": "teacher rank",
    "EngineNodeActor": "engine actor",
    "AgentWorker": "agent worker",
    "DashboardAgent": "ray dashboard agent",
    "RuntimeEnvAgent": "ray runtime-env agent",
    "IDLE": "ray idle worker",
}
"""Ray worker process title (`ray::<Class>[.<method>]`) → process kind."""
COMMANDS = (
    ("megarl.engines.embedded", "engine server"),
    ("sglang", "engine server"),
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard/dashboard.py", "ray dashboard"),
    ("log_monitor.py", "ray log_monitor"),
    ("autoscaler/_private/monitor.py", "ray monitor"),
    ("multiprocessing.resource_tracker", "mp resource tracker"),
    ("torch_shm_manager", "torch_shm_manager"),
)
"""(part of the command line, kind) for the processes that are not Ray workers, first match wins."""
Record = dict[str, Any]
CMD_CHARS = 100
"""Characters of each process's command line kept in its record."""


def process_kind(proc: psutil.Process, driver_pid: int, parent_kind: str) -> str:
    """What `proc` is: "driver", a Ray worker's role, "<parent kind> fork" (a forked child: Ray's title, its
    parent's image), "<parent kind> spawn child" (multiprocessing's spawn), a command of `COMMANDS`, or
    "<parent kind> child"."""
    if proc.pid == driver_pid:
        return "driver"
    argv = proc.cmdline()
    title = argv[0] if argv else proc.name()
    if title.startswith("ray::") and parent_kind != "raylet":  # a fork keeps its parent's title
        return f"{parent_kind} fork"
    if title.startswith("ray::"):
        cls = title[len("ray::") :].split(".")[0].split()[0]
        return RAY_CLASSES.get(cls, f"ray::{cls}")
    command = " ".join(argv) or proc.name()
    if "multiprocessing.spawn" in command:
        return f"{parent_kind} spawn child"
    for needle, kind in COMMANDS:
        if needle in command:
            return kind
    return f"{parent_kind} child"


def process_tree(driver_pid: int) -> Iterator[tuple[psutil.Process, str]]:
    """The driver and its descendants (Ray's processes, workers, engine servers), each with its kind."""
    kinds: dict[int, str] = {}
    root = psutil.Process(driver_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            parent = kinds.get(proc.ppid(), "?")
            kinds[proc.pid] = process_kind(proc, driver_pid, parent)
        except psutil.Error:  # exited while we looked
            continue
        yield proc, kinds[proc.pid]


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's /proc/<pid>/smaps_rollup in bytes: `Pss`, `Pss_Anon` (its heap and tensors' share),
    `Private_Clean` + `Private_Dirty` (USS), `Rss`, `Swap`, ..."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        values[key] = int(value.split()[0]) * 1024
    return values


def process_record(proc: psutil.Process, kind: str) -> Record | None:
    """PSS (`mem`; its forks' added later by `fold_forks`), anonymous PSS (`anon`: the same), USS and RSS, open
    files and threads of one process, its command line's start; None once it is gone."""
    try:
        with proc.oneshot():
            mem = smaps_rollup(proc.pid)
            return {
                "kind": kind,
                "pid": proc.pid,
                "ppid": proc.ppid(),
                "cmd": " ".join(proc.cmdline())[:CMD_CHARS],
                "mem": mem["Pss"],
                "anon": mem["Pss_Anon"],
                "pss": mem["Pss"],
                "pss_anon": mem["Pss_Anon"],
                "uss": mem["Private_Clean"] + mem["Private_Dirty"],
                "rss": mem["Rss"],
                "swap": mem["Swap"],
                "fds": proc.num_fds(),
                "threads": proc.num_threads(),
            }
    except (psutil.Error, OSError):  # gone while we looked
        return None


def fold_forks(records: list[Record]) -> None:
    """Adds each fork's PSS (and anonymous PSS) to its nearest ancestor that is no fork: a fork shares its
    parent's pages copy-on-write, so its parent's PSS falls by what the fork's rises while it lives; their sum
    does not."""
    by_pid = {r["pid"]: r for r in records}
    for record in records:
        owner = record
        while owner["kind"].endswith(" fork") and owner["ppid"] in by_pid:
            owner = by_pid[owner["ppid"]]
        if owner is not record:
            owner["mem"] += record["pss"]
            owner["anon"] += record["pss_anon"]


def shm_inodes(pid: int) -> dict[int, int]:
    """inode → bytes in use of every `/dev/shm` file `pid` holds open or mapped (deleted ones too)."""
    paths = []
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        if os.readlink(f"{fd_dir}/{fd}").startswith("/dev/shm/"):
            paths.append(f"{fd_dir}/{fd}")
    mapped: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            mapped.setdefault(fields[5], fields[0])
    paths += [f"/proc/{pid}/map_files/{span}" for span in mapped.values()]
    inodes = {}
    for path in paths:
        stat = os.stat(path)
        inodes[stat.st_ino] = stat.st_blocks * 512
    return inodes


def shm_records(pids: list[int]) -> list[Record]:
    """The run's `/dev/shm` files (those its processes hold), and the machine's `/dev/shm` in use."""
    inodes: dict[int, int] = {}
    for pid in pids:
        try:
            inodes.update(shm_inodes(pid))
        except OSError:  # exited while we looked
            continue
    machine = shutil.disk_usage("/dev/shm").used
    return [
        {"kind": "/dev/shm (run)", "mem": sum(inodes.values()), "fds": len(inodes)},
        {"kind": "/dev/shm (machine)", "mem": machine},
    ]


def raylet_address(procs: list[tuple[psutil.Process, str]]) -> tuple[str, int] | None:
    """(ip, node manager port) of the run's raylet, from the GCS its command line names (its own port flag is 0:
    the raylet picks one); None before it started."""
    from ray._private.internal_api import get_state_from_address
    from ray.exceptions import RaySystemError

    for proc, kind in procs:
        if kind != "raylet":
            continue
        flags = dict(arg.split("=", 1) for arg in proc.cmdline() if arg.startswith("--") and "=" in arg)
        try:
            nodes = get_state_from_address(flags["--gcs-address"]).node_table()
        except RaySystemError:  # the GCS does not answer yet
            return None
        node = next(n for n in nodes if n["Alive"] and n["RayletSocketName"] == flags["--raylet_socket_name"])
        return node["NodeManagerAddress"], int(node["NodeManagerPort"])
    return None


def object_store(address: tuple[str, int]) -> tuple[Record, dict[int, tuple[int, int]]]:
    """The store's bytes used and objects, and pid → (objects owned, tasks executed) for every Ray worker and
    driver."""
    from ray._private.internal_api import node_stats

    stats = node_stats(*address, include_memory_info=False)
    store = stats.store_stats
    record = {
        "kind": "object store",
        "mem": store.object_store_bytes_used,
        "objects": store.num_local_objects,
        "created": store.cumulative_created_objects,
    }
    return record, {w.pid: (w.num_owned_objects, w.num_executed_tasks) for w in stats.core_workers_stats}


def gpu_memory() -> dict[int, int]:
    """pid → GPU memory in use (bytes; what nvidia-smi sees: the caching allocator's reserve plus the context)."""
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return {int(pid): int(mib) * 2**20 for pid, mib in rows}


class Probe:
    """Samples a run's processes; keeps only the raylet's address between samples."""

    def __init__(self, driver_pid: int, cuda: bool) -> None:
        self.driver_pid = driver_pid
        self.cuda = cuda
        self._raylet: tuple[str, int] | None = None

    def sample(self, step: int) -> list[Record]:
        """One record per live process, the store, `/dev/shm` (run and machine), GPU per process on CUDA."""
        start = time.monotonic()
        procs = list(process_tree(self.driver_pid))
        records = [r for r in (process_record(p, k) for p, k in procs) if r is not None]
        fold_forks(records)
        records += shm_records([r["pid"] for r in records])
        records += self._store(procs, records)
        if self.cuda:
            records += self._gpu(records)
        seconds = time.monotonic() - start
        records.append({"kind": "sampler", "seconds": seconds})
        return [{"step": step, "time": time.time(), **r} for r in records]

    def _store(self, procs: list[tuple[psutil.Process, str]], records: list[Record]) -> list[Record]:
        """The object store's record; each process record gets the objects its pid owns (`objects`) and the Ray
        tasks (actor calls) it ran so far (`tasks`)."""
        self._raylet = self._raylet or raylet_address(procs)
        if self._raylet is None:
            return []
        try:
            store, owned = object_store(self._raylet)
        except grpc.RpcError:  # the raylet is going down (the run ends): no store sample this time
            return []
        for record in records:
            if record.get("pid") in owned:
                record["objects"], record["tasks"] = owned[record["pid"]]
        return [store]

    def _gpu(self, records: list[Record]) -> list[Record]:
        """`<kind> (GPU)` for every process nvidia-smi lists among the run's."""
        used = gpu_memory()
        procs = [r for r in records if r.get("pid") in used]
        return [{"kind": f"{r['kind']} (GPU)", "pid": r["pid"], "mem": used[r["pid"]]} for r in procs]
