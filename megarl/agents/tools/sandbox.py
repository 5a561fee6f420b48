"""The isolation the python tool runs model-written code in: probed once per interpreter, strongest first.

- "namespaces" (not root): `unshare --user --map-root-user --net --pid --kill-child`. A new network namespace
  (only a loopback that is down: no address, local or remote, is reachable, whatever API opens the socket), a new
  PID namespace (the code sees only its own processes, and all of them die with its init), and a user namespace
  in which the code is "root" but holds no capability outside it. The process cap is RLIMIT_NPROC, which binds
  because the real user is not root; the kernel counts it per user namespace, i.e. per call.
- "namespaces+cgroup" (root): the same namespaces, and each call in its own child of a writable `pids` cgroup
  with `pids.max`, because RLIMIT_NPROC does not bind root.
- "none": no isolation; the tool refuses to start unless its config says `allow_unsandboxed: true`.
"""

import asyncio
import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_NAMESPACES = ("--user", "--map-root-user", "--net", "--pid", "--kill-child")
_PROBE_TIMEOUT_S = 10.0
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_PREFIX = "megarl-python-tool-"
_RMDIR_TRIES = 50
# Moves itself into the cgroup ($0 is its cgroup.procs) before exec, so everything it starts is counted there.
_ENTER_CGROUP = 'echo 0 > "$0" && exec "$@"'


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How to start a sandboxed process: the argv prefix, and where each run gets its own pids cgroup."""

    name: str
    """"namespaces", "namespaces+cgroup" or "none" (see the module docstring)."""
    argv: tuple[str, ...] = ()
    pids_cgroup: Path | None = None
    """A writable pids cgroup under which each run gets a child with `pids.max`; None: RLIMIT_NPROC caps it."""
    reason: str = ""
    """Why nothing stronger holds here (for "none")."""


NO_SANDBOX = Sandbox("none", reason="no isolation was asked for")


@cache
def probe_sandbox(python: str) -> Sandbox:
    """The strongest isolation that works on this machine for `python` (probed once per interpreter)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return Sandbox("none", reason="the `unshare` program (util-linux) is not installed")
    argv = (unshare, *_NAMESPACES)
    error = _failure([*argv, python, "-I", "-c", "pass"])
    if error:
        return Sandbox("none", reason=f"`unshare {' '.join(_NAMESPACES)}` fails here: {error}")
    if os.geteuid() != 0:
        return Sandbox("namespaces", argv)
    cgroup = _writable_pids_cgroup()
    if cgroup is None:
        return Sandbox(
            "none", reason="running as root (RLIMIT_NPROC does not bind root) and no pids cgroup is writable"
        )
    return Sandbox("namespaces+cgroup", argv, cgroup)


@contextlib.asynccontextmanager
async def sandbox_argv(sandbox: Sandbox, max_processes: int) -> AsyncIterator[list[str]]:
    """The argv prefix for one run; with a pids cgroup, in a fresh child cgroup removed afterwards."""
    if sandbox.pids_cgroup is None:
        yield list(sandbox.argv)
        return
    cgroup = sandbox.pids_cgroup / f"{_CGROUP_PREFIX}{uuid.uuid4().hex}"
    cgroup.mkdir()
    try:
        (cgroup / "pids.max").write_text(str(max_processes))
        yield ["/bin/sh", "-c", _ENTER_CGROUP, str(cgroup / "cgroup.procs"), *sandbox.argv]
    finally:
        await _remove_cgroup(cgroup)


def _failure(argv: list[str]) -> str:
    """ "" when `argv` exits 0, else what went wrong."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return "" if done.returncode == 0 else done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"


def _writable_pids_cgroup() -> Path | None:
    """This process's pids cgroup (v1 hierarchy, or v2 with pids delegated) if it can create capped children."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "pids":
            candidate = _CGROUP_ROOT / "pids" / path.lstrip("/")
        elif controllers == "":
            candidate = _CGROUP_ROOT / path.lstrip("/")
            if "pids" not in _read(candidate / "cgroup.subtree_control").split():
                continue
        else:
            continue
        if _can_create_child(candidate):
            return candidate
    return None


def _can_create_child(cgroup: Path) -> bool:
    child = cgroup / f"{_CGROUP_PREFIX}probe-{uuid.uuid4().hex}"
    try:
        child.mkdir()
    except OSError:
        return False
    try:
        return (child / "pids.max").exists()
    finally:
        child.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


async def _remove_cgroup(cgroup: Path) -> None:
    """rmdir the run's cgroup; the kernel may take a moment to let go of tasks that just died (EBUSY)."""
    for _ in range(_RMDIR_TRIES - 1):
        try:
            cgroup.rmdir()
            return
        except OSError:
            await asyncio.sleep(0.01)
    cgroup.rmdir()
