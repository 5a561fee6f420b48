"""`PythonTool`: runs the model's Python code in a subprocess and returns its stdout and stderr.

Arguments: `{"code": "<python source>"}`. Each call runs `python -I -u -c <prelude> main.py ...` in a fresh temporary
working directory (also its HOME and TMPDIR, deleted afterwards), with stdin from /dev/null and an environment of
only PATH, LANG, HOME, TMPDIR and `*_NUM_THREADS=1`; at most `max_concurrency` calls run at once.

What the sandbox limits, and how:

- Network: when `unshare --user --net --map-root-user` works on this machine (probed once per process), the child
  runs in a new network namespace with only a loopback interface that is down, so no address is reachable. In every
  case the prelude also replaces `socket.socket` (all families but AF_UNIX), `socket.create_connection`,
  `socket.getaddrinfo` and the other name lookups with functions raising
  `PermissionError("network access is disabled in the python tool")`.
- Time: the whole process group (`start_new_session`) is killed after `timeout_s` of wall-clock time; RLIMIT_CPU
  (`ceil(timeout_s) + 1` s) also stops CPU-bound code whose wall clock is stretched by a busy machine.
- Resources, set by the prelude before the user code runs (limits can only be lowered, never raised back without
  privileges): RLIMIT_AS `memory_mb` (large allocations raise MemoryError), RLIMIT_FSIZE 16 MiB per written file,
  RLIMIT_CORE 0, RLIMIT_NPROC 64 (within the user namespace this counts the sandbox's own tasks; without it, every
  task of the user; root ignores it).
- Output: stdout and stderr are read concurrently, keeping only the first and the last `4 * max_output_chars` bytes
  of each, and the text the model reads keeps the head and the tail of stdout + stderr, `max_output_chars` in all,
  with a marker saying how many characters were cut.

It is NOT a security boundary against a determined attacker: the code runs as the trainer's user and can read (and,
outside the temporary directory, write) any file that user can, including checkpoints and credentials on disk; it can
bypass the Python-level network guard through `_socket` or ctypes (only the network namespace stops that, and only
where `unshare` works); and a process that leaves the process group (`os.setsid`) survives the timeout kill. Run
untrusted workloads in a container or VM without secrets.
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
from typing import Any

from megarl.agents.tools.base import BaseTool, ToolResult

_NETWORK_NAMESPACE = ("--user", "--net", "--map-root-user")
_CODE_FILE = "main.py"
_MAX_FILE_BYTES = 16 << 20
_MAX_PROCESSES = 64
_PROBE_TIMEOUT_S = 10.0
_DRAIN_GRACE_S = 1.0
_UTF8_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
_CONFIG_KEYS = ("timeout_s", "memory_mb", "max_output_chars", "max_concurrency", "python")

# Runs in the child before the user code; argv: code file, RLIMIT_AS bytes, RLIMIT_CPU seconds, FSIZE, NPROC.
# The user code is compiled as "<tool>" and registered with linecache so tracebacks show its lines, and the
# excepthook drops this prelude's own frame from them.
_PRELUDE = """\
def _sandbox():
    import linecache, resource, socket, sys, traceback
    path, memory, cpu, fsize, nproc = sys.argv[1], *map(int, sys.argv[2:])
    limits = {"AS": memory, "CPU": cpu, "FSIZE": fsize, "NPROC": nproc, "CORE": 0}
    for name, value in limits.items():
        which = getattr(resource, "RLIMIT_" + name)
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

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

_unshare_argv: list[str] | None = None
"""`unshare ...` prefix that puts the child in a new network namespace, `[]` where that fails; probed once."""


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
    `max_concurrency` (4 subprocesses at once), `python` (the interpreter; default this one's).
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
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
        limits = [self.memory_mb << 20, math.ceil(self.timeout_s) + 1, _MAX_FILE_BYTES, _MAX_PROCESSES]
        argv = [self.python, "-I", "-u", "-c", _PRELUDE, _CODE_FILE, *map(str, limits)]
        loop = asyncio.get_running_loop()
        start = loop.time()
        proc = await asyncio.create_subprocess_exec(
            *await _network_namespace_argv(self.python),
            *argv,
            cwd=workdir,
            env=_child_env(workdir),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = _Capture(4 * self.max_output_chars), _Capture(4 * self.max_output_chars)
        readers = asyncio.gather(stdout.drain(proc.stdout), stderr.drain(proc.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # the timed-out child, or what an exited one left running in the background
            returncode = await proc.wait()
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


async def _network_namespace_argv(python: str) -> list[str]:
    """The `unshare` prefix for a new user + network namespace, or `[]` where `unshare` is missing or fails here."""
    global _unshare_argv
    if _unshare_argv is None:
        unshare = shutil.which("unshare")
        argv = [unshare, *_NETWORK_NAMESPACE] if unshare else []
        if argv and not await _succeeds([*argv, python, "-I", "-c", "pass"]):
            argv = []
        _unshare_argv = argv
    return _unshare_argv


async def _succeeds(argv: list[str]) -> bool:
    devnull = asyncio.subprocess.DEVNULL
    proc = await asyncio.create_subprocess_exec(*argv, stdin=devnull, stdout=devnull, stderr=devnull)
    try:
        return await asyncio.wait_for(proc.wait(), _PROBE_TIMEOUT_S) == 0
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False


def _child_env(workdir: str) -> dict[str, str]:
    """PATH and LANG, home and temp dir in the work dir, one thread per numeric library; nothing else."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    return env | {key: "1" for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


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
