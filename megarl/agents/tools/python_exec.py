"""`PythonTool`: runs the model's Python code in a subprocess and returns its stdout and stderr.

Arguments: `{"code": "<python source>"}`. Each call runs `python -I -u -c <prelude> main.py ...` in a fresh temporary
working directory (also its HOME and TMPDIR, deleted afterwards), with stdin from /dev/null and an environment of
only PATH, LANG, HOME, TMPDIR and `*_NUM_THREADS=1`; at most `max_concurrency` calls run at once.

Isolation (megarl/agents/tools/sandbox.py), probed when the tool is built; the strongest that works here is used:

- "namespaces" (trainer not root) and "namespaces+cgroup" (root): the code runs under `unshare --user
  --map-root-user --net --pid --kill-child`. Protects against: network access by any route (`socket`, `_socket`,
  ctypes, subprocesses: the new network namespace has only a loopback that is down, so even 127.0.0.1 and abstract
  unix sockets of the host are unreachable); fork bombs (at most 64 tasks per call: RLIMIT_NPROC, which the kernel
  counts per user namespace and which binds because the real user is not root; as root, a per-call `pids` cgroup
  with `pids.max` 64 instead); leftover processes (the code runs as pid 2 under an init of its own PID namespace;
  when that init dies, at exit or at the timeout kill, the kernel kills everything in the namespace, `setsid` or
  not); seeing or signalling the host's processes; host capabilities (it is "root" only inside its namespace).
- "none": refused unless the config says `allow_unsandboxed: true`; then only the Python-level guards below hold.

Guards in every mode: the prelude replaces `socket.socket` (all families but AF_UNIX), `socket.create_connection`,
`socket.getaddrinfo` and the other name lookups with functions raising
`PermissionError("network access is disabled in the python tool")` (so the model reads a clear error; `_socket` or
ctypes bypass it); resource limits set before the user code runs (lowering only; raising needs CAP_SYS_RESOURCE on
the host, which the code never has in a namespace): RLIMIT_AS `memory_mb` (large allocations raise MemoryError),
RLIMIT_FSIZE 16 MiB per written file, RLIMIT_CORE 0, RLIMIT_NPROC 64 (without a namespace it counts every task of
the user, and root ignores it), RLIMIT_CPU `ceil(timeout_s) + 1` s; the process group (`start_new_session`) is
killed after `timeout_s` of wall-clock time.

Output: stdout and stderr are read concurrently, keeping only the first and the last `4 * max_output_chars` bytes
of each, and the text the model reads keeps the head and the tail of stdout + stderr, `max_output_chars` in all,
with a marker saying how many characters were cut.

What no mode protects against: the code runs with the trainer's uid (inside the user namespace its "root" is that
uid), so it can read, and outside the temporary directory write, every file that user can, including checkpoints,
caches and credentials on disk; it can connect to unix sockets that live in the filesystem (e.g. Ray's under
/tmp/ray) because those are not scoped by the network namespace; it can fill the disk with many files of 16 MiB;
it shares the host kernel, so a kernel exploit escapes. Run untrusted workloads in a container or VM without secrets.
"""

import asyncio
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.agents.tools.base import BaseTool, ToolResult
from megarl.agents.tools.sandbox import Sandbox, probe_sandbox, sandbox_argv

_CODE_FILE = "main.py"
_MAX_FILE_BYTES = 16 << 20
_MAX_PROCESSES = 64
_DRAIN_GRACE_S = 1.0
_UTF8_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
_CONFIG_KEYS = ("timeout_s", "memory_mb", "max_output_chars", "max_concurrency", "python", "allow_unsandboxed")
_STATUS_BYTES = 16

# Runs in the child before the user code; argv: code file, RLIMIT_AS bytes, RLIMIT_CPU seconds, FSIZE, NPROC, and
# the fd to report the code's exit status on. As the init of a PID namespace (pid 1, which ignores the signals it
# sends itself) it runs the code in a child, reaps, and writes the child's exit code to that fd; on SIGTERM it
# SIGKILLs every other process of the namespace (what the tool sends at the timeout).
# The user code is compiled as "<tool>" and registered with linecache so tracebacks show its lines, and the
# excepthook drops this prelude's own frame from them.
_PRELUDE = """\
def _sandbox():
    import linecache, os, resource, signal, socket, sys, traceback
    path, memory, cpu, fsize, nproc, status_fd = sys.argv[1], *map(int, sys.argv[2:])
    limits = {"AS": memory, "CPU": cpu, "FSIZE": fsize, "NPROC": nproc, "CORE": 0}
    for name, value in limits.items():
        which = getattr(resource, "RLIMIT_" + name)
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(-1, signal.SIGKILL))  # the tool's timeout kill
        if child := os.fork():
            while (done := os.wait())[0] != child:
                pass
            os.write(status_fd, str(os.waitstatus_to_exitcode(done[1])).encode())
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.close(status_fd)

    def deny(*args, **kwargs):
        raise PermissionError("network access is disabled in the python tool")

    class NoNetworkSocket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if family != socket.AF_UNIX:
                deny()
            super().__init__(family, type, proto, fileno)

    socket.socket = NoNetworkSocket
    for name in ("create_connection", "create_server", "getaddrinfo", "getnameinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr"):
        setattr(socket, name, deny)
    sys.excepthook = lambda kind, error, tb: traceback.print_exception(kind, error, tb and tb.tb_next)
    with open(path) as f:
        source = f.read()
    linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
    sys.argv = ["<tool>"]
    return source, "<tool>", "exec"
exec(compile(*globals().pop("_sandbox")()))
"""


@dataclass(slots=True)
class _Capture:
    """The first and the last `limit` bytes of a stream, and how many characters between them were dropped."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    num_dropped: int = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            room = max(0, self.limit - len(self.head))
            self.head += chunk[:room]
            self.tail += chunk[room:]
            excess = len(self.tail) - self.limit
            if excess > 0:
                self.num_dropped += len(self.tail[:excess].translate(None, _UTF8_CONTINUATION_BYTES))
                del self.tail[:excess]
                while self.tail and self.tail[0] in _UTF8_CONTINUATION_BYTES:  # the rest of a dropped character
                    del self.tail[0]

    def text(self) -> str:
        return (self.head + self.tail).decode("utf-8", errors="replace")


class PythonTool(BaseTool):
    """Runs `arguments["code"]` with `python` in a sandboxed subprocess (see the module docstring).

    config (all optional): `timeout_s` (5.0), `memory_mb` (512, RLIMIT_AS), `max_output_chars` (4000),
    `max_concurrency` (4 subprocesses at once), `python` (the interpreter; default this one's), `allow_unsandboxed`
    (false: refuse to start where no sandbox holds; true: run the code without one there).
    `sandbox`: the isolation to use; None probes this machine for the strongest (tests pass `NO_SANDBOX`).
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any], *, sandbox: Sandbox | None = None) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"tool {self.name!r}: unknown config.{unknown[0]}; the settings are {_CONFIG_KEYS}")
        self.timeout_s = _positive_float(config, "timeout_s", 5.0)
        self.memory_mb = _positive_int(config, "memory_mb", 512)
        self.max_output_chars = _positive_int(config, "max_output_chars", 4000)
        self.python = config.get("python", sys.executable)
        if not isinstance(self.python, str) or not self.python:
            raise ValueError(f"config.python must be the path of a Python interpreter, got {self.python!r}")
        self._semaphore = asyncio.Semaphore(_positive_int(config, "max_concurrency", 4))
        allow_unsandboxed = config.get("allow_unsandboxed", False)
        if not isinstance(allow_unsandboxed, bool):
            raise ValueError(f"config.allow_unsandboxed must be true or false, got {allow_unsandboxed!r}")
        self.sandbox = probe_sandbox(self.python) if sandbox is None else sandbox
        if self.sandbox.name == "none" and not allow_unsandboxed:
            raise ValueError(
                f"tool {self.name!r} would run model-written code with no sandbox: {self.sandbox.reason}. Run where "
                "`unshare --user --net --pid` works (and, as root, a pids cgroup is writable), or set "
                "`config.allow_unsandboxed: true` to run it anyway with only the Python-level guards"
            )

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text='Error: pass the Python source as {"code": "<python source>"}.')
        async with self._semaphore:
            workdir = tempfile.mkdtemp(prefix="megarl-python-tool-")
            try:
                return await self._run(code, workdir)
            finally:
                await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)

    async def _run(self, code: str, workdir: str) -> ToolResult:
        with open(os.path.join(workdir, _CODE_FILE), "w") as f:
            f.write(code)
        async with sandbox_argv(self.sandbox, _MAX_PROCESSES) as prefix:
            status_read, status_write = os.pipe()
            limits = [self.memory_mb << 20, math.ceil(self.timeout_s) + 1, _MAX_FILE_BYTES, _MAX_PROCESSES]
            argv = [self.python, "-I", "-u", "-c", _PRELUDE, _CODE_FILE, *map(str, [*limits, status_write])]
            try:
                return await self._spawn([*prefix, *argv], workdir, status_read, status_write)
            finally:
                os.close(status_read)

    async def _spawn(self, argv: list[str], workdir: str, status_read: int, status_write: int) -> ToolResult:
        """Run `argv`, capture its output, kill it at the timeout; the code's exit status comes on `status_read`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=_child_env(workdir),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_write,),
            )
        finally:
            os.close(status_write)
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = _Capture(4 * self.max_output_chars), _Capture(4 * self.max_output_chars)
        readers = asyncio.gather(stdout.drain(proc.stdout), stderr.drain(proc.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None and self.sandbox.argv:
                await _stop_namespace(proc)
            _kill_group(proc.pid)  # the timed-out child, or what an exited one left running in the background
            returncode = _code_status(status_read, await proc.wait())
            with contextlib.suppress(TimeoutError):  # EOF comes unless an escaped process holds the pipes
                await asyncio.wait_for(readers, _DRAIN_GRACE_S)
        body = _output(stdout, stderr, self.max_output_chars)
        status = f"Execution timed out after {self.timeout_s:g} s" if timed_out else _exit_status(returncode)
        text = "\n".join(part for part in (body.rstrip("\n"), status) if part) or "(no output)"
        metrics = {"exec_seconds": loop.time() - start, "timed_out": int(timed_out), "exit_code": returncode}
        return ToolResult(text=text, metrics=metrics)


def _positive_float(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.{key} must be a number > 0, got {value!r}; set e.g. `{key}: {default}`")
    return float(value)


def _positive_int(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.{key} must be an integer >= 1, got {value!r}; set e.g. `{key}: {default}`")
    return value


def _code_status(status_read: int, returncode: int) -> int:
    """The code's exit code as its PID namespace's init reported it, else (no init, or killed) `returncode`.

    Read without blocking: an init killed at the timeout may still hold the pipe open for a moment.
    """
    os.set_blocking(status_read, False)
    try:
        reported = os.read(status_read, _STATUS_BYTES)
    except BlockingIOError:
        return returncode
    return int(reported) if reported else returncode


def _child_env(workdir: str) -> dict[str, str]:
    """PATH and LANG, home and temp dir in the work dir, one thread per numeric library; nothing else."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    return env | {key: "1" for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


async def _stop_namespace(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the init of the code's PID namespace (unshare's one child), which SIGKILLs everything else there,
    reports the code's status and exits; wait for unshare to follow.

    Killing unshare or the init instead would orphan the init to the host's pid 1, which in many containers never
    reaps it, or make unshare print an error of its own into the output.
    """
    with contextlib.suppress(OSError):  # unshare exited meanwhile
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), _DRAIN_GRACE_S)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _output(stdout: _Capture, stderr: _Capture, max_chars: int) -> str:
    """stdout, then stderr under a `[stderr]` label, cut to `max_chars`."""
    body = stdout.text()
    if stderr.head:
        separator = "\n" if body and not body.endswith("\n") else ""
        body = f"{body}{separator}[stderr]\n{stderr.text()}"
    return _truncate(body, max_chars, stdout.num_dropped + stderr.num_dropped)


def _exit_status(returncode: int) -> str:
    """How the process ended, or "" when it exited cleanly."""
    if returncode > 0:
        return f"exit code {returncode}"
    if returncode < 0:
        name = {sig.value: sig.name for sig in signal.Signals}.get(-returncode, str(-returncode))
        return f"killed by signal {name} (memory or CPU limit?)"
    return ""


def _truncate(text: str, max_chars: int, num_dropped: int) -> str:
    """Keep the head and the tail of `text`, saying how many characters were cut (`num_dropped` already were)."""
    num_cut = max(0, len(text) - max_chars) + num_dropped
    if num_cut == 0:
        return text
    head = max_chars // 2
    return f"{text[:head]}\n... [{num_cut} characters cut] ...\n{text[len(text) - (max_chars - head) :]}"
