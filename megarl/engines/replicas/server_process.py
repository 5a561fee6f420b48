"""A server command run as a child process: its own process group, its output logged, its health polled.

Usage::

    server = ServerProcess([sys.executable, "-m", "sglang.launch_server", ...], log_path="logs/replica0.log")
    server.wait_healthy("http://127.0.0.1:30000/health_generate", timeout_s=600)
    ...
    server.stop()

The child runs in a new session, so `stop()` reaches everything it spawned (SGLang starts scheduler
and detokenizer processes) with one signal to the group, and a Ctrl-C meant for the trainer does
not reach the server directly.
"""

import http.client
import itertools
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

logger = logging.getLogger(__name__)

NUM_TAIL_LINES = 20
"""Log lines quoted in start-up errors."""
SECRET_FLAGS = ("--api-key", "--admin-api-key")
"""Flags whose values are masked wherever a `ServerProcess` logs them: in its command line and in the server's
own output (SGLang logs its server_args, keys included: srt/entrypoints/engine.py::_server_args_for_logging
redacts only watermark secrets)."""
MASK = "<redacted>"

# Health polls go straight to the server: a proxy from HTTP(S)_PROXY must not answer for it.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


_PROC = Path("/proc")


def _has_running_member(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (Linux /proc); zombies do not count.

    Orphaned members become zombies of whoever adopts them, and some container init processes
    never reap them: waiting for those would always run into the SIGKILL timeout.
    """
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]  # the name before ")" may contain spaces
        if int(group) == pgid and state != "Z":
            return True
    return False


def command_secrets(command: list[str]) -> tuple[str, ...]:
    """The values given to `SECRET_FLAGS` in `command`."""
    return tuple(value for flag, value in itertools.pairwise(command) if flag in SECRET_FLAGS and value)


def _short_name(command: list[str]) -> str:
    """`sglang.launch_server` for `python -m sglang.launch_server ...`, else the program's file name."""
    if "-m" in command[:-1]:
        return command[command.index("-m") + 1]
    return Path(command[0]).name


class ServerProcess:
    """A running server command; its combined stdout/stderr goes line by line to `log_path` and to `logger`.

    The process starts in the constructor. `env` entries override the parent's environment;
    PYTHONUNBUFFERED=1 is set unless `env` says otherwise, so a Python server's last words reach
    the log before it dies.
    """

    def __init__(self, command: list[str], *, log_path: str | Path, env: Mapping[str, str] | None = None) -> None:
        if not command:
            raise ValueError("command is empty")
        self.command = list(command)
        self._secrets = command_secrets(self.command)
        self.log_path = Path(log_path)
        self.name = _short_name(self.command)
        self._tail: deque[str] = deque(maxlen=NUM_TAIL_LINES)
        self._tail_lock = threading.Lock()
        self._stopped = False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = self.log_path.open("a", encoding="utf-8")
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
                text=True,
                encoding="utf-8",
                errors="replace",
            )
        except BaseException:
            log_file.close()
            raise
        assert self._proc.stdout is not None
        self._reader = threading.Thread(
            target=self._pump, args=(self._proc.stdout, log_file), name=f"log-{self.name}-{self.pid}", daemon=True
        )
        self._reader.start()
        logger.info("started %s (pid %d), log %s: %s", self.name, self.pid, self.log_path, self.shown_command)

    @property
    def shown_command(self) -> str:
        """The command line as logs show it, its secrets masked."""
        return self._masked(shlex.join(self.command))

    def _masked(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    def _pump(self, stdout: IO[str], log_file: IO[str]) -> None:
        """Copy the child's output to the log file, the logger and the tail, until every writer closes the pipe."""
        with stdout, log_file:
            for raw in stdout:
                raw = self._masked(raw)
                line = raw.rstrip("\n")
                log_file.write(raw)
                log_file.flush()
                logger.info("[%s %d] %s", self.name, self.pid, line)
                with self._tail_lock:
                    self._tail.append(line)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has exited (negative: killed by that signal), else None."""
        return self._proc.poll()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self) -> list[str]:
        """The last `NUM_TAIL_LINES` lines the process printed."""
        with self._tail_lock:
            return list(self._tail)

    def _failure(self, what: str) -> RuntimeError:
        tail = "\n".join(f"    {line}" for line in self.log_tail()) or "    (no output)"
        return RuntimeError(
            f"{self.name} (pid {self.pid}) {what}\n"
            f"  command: {self.shown_command}\n"
            f"  last {NUM_TAIL_LINES} log lines ({self.log_path}):\n{tail}"
        )

    def wait_healthy(
        self, url: str, timeout_s: float, *, poll_interval_s: float = 0.5, request_timeout_s: float = 10.0
    ) -> None:
        """Poll GET `url` until it answers 200.

        Raises RuntimeError (naming the command, the URL and the last log lines) if the process
        exits first or `timeout_s` passes; the process is left as it is (call `stop()`).
        Each poll waits at most `request_timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        last_error = "no poll yet"
        while True:
            if not self.alive:
                self._reader.join(timeout=5.0)  # let the last lines reach the tail
                raise self._failure(f"exited with code {self.returncode} before {url} answered 200")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(f"did not answer 200 on {url} within {timeout_s:g} s (last poll: {last_error})")
            try:
                with _DIRECT.open(url, timeout=min(request_timeout_s, remaining)) as reply:
                    if reply.status == 200:
                        return
                    last_error = f"HTTP {reply.status}"
            except urllib.error.HTTPError as e:
                last_error = f"HTTP {e.code}"
            except (OSError, http.client.HTTPException) as e:  # refused while starting, poll timed out, reset
                last_error = str(getattr(e, "reason", e)) or type(e).__name__
            time.sleep(min(poll_interval_s, max(deadline - time.monotonic(), 0.0)))

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the whole process group, wait up to `timeout_s` for it to empty, then SIGKILL it.

        Returns the exit status of the server process. Calling it again does nothing more.
        """
        if not self._stopped:
            self._stopped = True
            pgid = self.pid  # start_new_session: the child leads its own group
            if self._signal_group(pgid, signal.SIGTERM):
                deadline = time.monotonic() + timeout_s
                while self._group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._group_alive(pgid):
                    logger.warning("%s (pid %d) outlived SIGTERM by %g s; sending SIGKILL", self.name, pgid, timeout_s)
                    self._signal_group(pgid, signal.SIGKILL)
            self._proc.wait()
            self._reader.join(timeout=5.0)
            logger.info("stopped %s (pid %d), exit status %s", self.name, pgid, self._proc.returncode)
        return self._proc.returncode

    def _group_alive(self, pgid: int) -> bool:
        self._proc.poll()  # reap the leader so it does not count as a member
        return self._signal_group(pgid, 0) and (not _PROC.is_dir() or _has_running_member(pgid))

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> bool:
        """Send `sig` to the group; False if it has no members left."""
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
