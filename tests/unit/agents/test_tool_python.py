"""`PythonTool`: output, errors, timeout, memory limit, network guard, truncation, config, concurrency, and the
sandbox: network namespace, fork bomb, leftover processes, refusal without isolation.

The sandbox tests run where `probe_sandbox` finds one (skipped elsewhere, e.g. a container that forbids `unshare`);
the others run sandboxed where possible and unsandboxed elsewhere (`allow_unsandboxed: true`).
"""

import asyncio
import itertools
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megarl.agents.tools.base import ToolResult
from megarl.agents.tools.python_exec import PythonTool
from megarl.agents.tools.sandbox import NO_SANDBOX, probe_sandbox

SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
SANDBOX = probe_sandbox(sys.executable)
needs_sandbox = pytest.mark.skipif(SANDBOX.name == "none", reason=f"no sandbox on this machine: {SANDBOX.reason}")


def make_tool(**config: Any) -> PythonTool:
    return PythonTool({"allow_unsandboxed": True, **config}, SCHEMA)


def run(tool: PythonTool, code: str) -> ToolResult:
    return asyncio.run(tool.execute("trajectory-0", {"code": code}))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP socket listening on 127.0.0.1 that the tool's code must never reach."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


def assert_no_connection(server: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        server.accept()


def test_prints_stdout() -> None:
    result = run(make_tool(), "print(2 + 3)")
    assert result.text == "5"
    assert result.metrics["exit_code"] == 0
    assert result.metrics["timed_out"] == 0
    assert result.reward == 0.0


def test_exception_shows_user_traceback() -> None:
    result = run(make_tool(), "def f():\n    return 1 / 0\n\nf()")
    assert "ZeroDivisionError: division by zero" in result.text
    assert 'File "<tool>", line 2, in f' in result.text
    assert "return 1 / 0" in result.text  # the source line, from linecache
    assert "<string>" not in result.text  # the prelude's frame is hidden
    assert result.text.endswith("exit code 1")
    assert result.metrics["exit_code"] == 1


def test_syntax_error_points_at_the_user_line() -> None:
    result = run(make_tool(), "x = 1\nprint(x")
    assert 'File "<tool>", line 2' in result.text
    assert "SyntaxError" in result.text
    assert "<string>" not in result.text
    assert result.metrics["exit_code"] == 1


def test_infinite_loop_times_out_with_partial_output() -> None:
    result = run(make_tool(timeout_s=1), "print('started', flush=True)\nwhile True:\n    pass")
    assert "Execution timed out after 1 s" in result.text
    assert "started" in result.text
    assert result.metrics["timed_out"] == 1


def test_large_allocation_raises_memory_error() -> None:
    result = run(make_tool(memory_mb=256), "x = bytearray(2_000_000_000)")
    assert "MemoryError" in result.text
    assert result.metrics["exit_code"] == 1


def test_killed_by_signal_is_readable() -> None:
    result = run(make_tool(), "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.text == "killed by signal SIGKILL (memory or CPU limit?)"
    assert result.metrics["exit_code"] == -9
    assert result.metrics["timed_out"] == 0


@pytest.mark.parametrize(
    "attempt",
    [
        "socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "socket.socket().connect(('127.0.0.1', {port}))",
        "socket.getaddrinfo('localhost', {port})",
    ],
)
def test_network_is_blocked_by_the_prelude(listener: socket.socket, attempt: str) -> None:
    port = listener.getsockname()[1]
    result = run(make_tool(), "import socket\n" + attempt.format(port=port))
    assert "PermissionError: network access is disabled in the python tool" in result.text
    assert result.metrics["exit_code"] == 1
    assert_no_connection(listener)


RAW_SOCKET = "import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected!')"
# libc socket() + connect() through ctypes: no Python socket object at all.
CTYPES_SOCKET = """\
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
address = struct.pack("=H", 2) + struct.pack("!H4s8x", {port}, bytes([127, 0, 0, 1]))  # sockaddr_in
if libc.connect(fd, address, len(address)) == 0:
    print("connected!")
print("errno", ctypes.get_errno())
"""


@needs_sandbox
@pytest.mark.parametrize("code", [RAW_SOCKET, CTYPES_SOCKET], ids=["_socket", "ctypes"])
def test_network_namespace_blocks_sockets_that_bypass_the_guard(listener: socket.socket, code: str) -> None:
    result = run(PythonTool({}, SCHEMA), code.format(port=listener.getsockname()[1]))
    assert "connected!" not in result.text
    assert "Network is unreachable" in result.text or "errno 101" in result.text  # ENETUNREACH: no route at all
    assert_no_connection(listener)


# Forks 2**9 = 512 processes if nothing stops it (bounded, so a broken sandbox cannot take the machine down), then
# sleeps until the timeout kill. Its first line names its PID namespace, to look for survivors afterwards.
FORK_BOMB = """\
import os, time
print(os.readlink("/proc/self/ns/pid"), flush=True)
for _ in range(9):
    try:
        os.fork()
    except BlockingIOError:
        print("fork refused", flush=True)
        break
time.sleep(60)
"""


@needs_sandbox
def test_fork_bomb_is_capped_and_leaves_no_process() -> None:
    result = run(PythonTool({"timeout_s": 2}, SCHEMA), FORK_BOMB)
    assert "fork refused" in result.text  # the per-call process cap (RLIMIT_NPROC or pids.max) held
    assert result.metrics["timed_out"] == 1
    assert result.metrics["exit_code"] == -9
    assert result.text.endswith("fork refused\nExecution timed out after 2 s")  # nothing from unshare itself
    namespace = result.text.splitlines()[0]
    assert namespace != os.readlink("/proc/self/ns/pid")  # the code ran in a PID namespace of its own
    assert namespace not in pid_namespaces_in_use()  # killing its init took every process down with it


def pid_namespaces_in_use() -> set[str]:
    namespaces = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            namespaces.add(os.readlink(f"/proc/{pid}/ns/pid"))
        except OSError:  # exited meanwhile, or not ours to inspect
            continue
    return namespaces


@needs_sandbox
def test_background_process_dies_with_the_call() -> None:
    """A child that leaves the process group (setsid) still dies: it is in the call's PID namespace."""
    code = (
        "import os, subprocess\nprint(os.readlink('/proc/self/ns/pid'))\n"
        "subprocess.Popen(['sleep', '60'], start_new_session=True)"
    )
    result = run(PythonTool({}, SCHEMA), code)
    assert result.metrics["exit_code"] == 0
    assert result.text.splitlines()[0] not in pid_namespaces_in_use()


def test_refuses_to_start_without_a_sandbox() -> None:
    with pytest.raises(ValueError, match=r"no sandbox.*config\.allow_unsandboxed: true"):
        PythonTool({}, SCHEMA, sandbox=NO_SANDBOX)


def test_allow_unsandboxed_runs_without_a_sandbox() -> None:
    tool = PythonTool({"allow_unsandboxed": True}, SCHEMA, sandbox=NO_SANDBOX)
    result = run(tool, "import os\nprint(os.getpid() > 1, os.readlink('/proc/self/ns/pid'))")
    assert result.text == f"True {os.readlink('/proc/self/ns/pid')}"  # really no namespace


def test_output_is_truncated_with_a_count() -> None:
    result = run(make_tool(max_output_chars=100), "print('x' * 10000, end='')")
    assert "[9900 characters cut]" in result.text
    assert result.text.count("x") == 100


def test_truncation_keeps_the_end_of_the_traceback() -> None:
    result = run(make_tool(max_output_chars=200), "print('y' * 100000)\nraise KeyError('the end')")
    assert "characters cut" in result.text
    assert result.text.startswith("y")
    assert "KeyError: 'the end'" in result.text
    assert result.text.endswith("exit code 1")


@pytest.mark.parametrize("arguments", [{}, {"code": 42}])
def test_missing_code_is_an_error_message(arguments: dict[str, Any]) -> None:
    result = asyncio.run(make_tool().execute("trajectory-0", arguments))
    assert result.text.startswith("Error:")
    assert '"code"' in result.text


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"memory_mb": -1}, "memory_mb"),
        ({"max_output_chars": 1.5}, "max_output_chars"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"python": ""}, "python"),
        ({"allow_unsandboxed": "yes"}, "allow_unsandboxed"),
        ({"timeout": 5}, "timeout"),
    ],
)
def test_bad_config_names_the_key(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"config\.{key}\b"):
        make_tool(**config)


def test_isolated_environment_and_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.environ))\nprint(input())"
    result = run(make_tool(), code)
    workdir = result.text.splitlines()[0]
    assert "MEGARL_TEST_SECRET" not in result.text
    assert "HTTPS_PROXY" not in result.text
    assert "EOFError" in result.text  # stdin is /dev/null
    assert not Path(workdir).exists()


def test_concurrency_limit_is_honored() -> None:
    """With max_concurrency=1 no two calls overlap in time (CLOCK_MONOTONIC is shared by every process). The timeout
    is far above the default 5 s: on CI's 2 cores, busy with two test files, a call once took longer to start."""
    code = "import time\nstart = time.monotonic()\ntime.sleep(0.2)\nprint(start, time.monotonic())"
    tool = make_tool(max_concurrency=1, timeout_s=60)

    async def three_calls() -> list[ToolResult]:
        return await asyncio.gather(*(tool.execute(f"trajectory-{i}", {"code": code}) for i in range(3)))

    spans = sorted(tuple(map(float, result.text.split())) for result in asyncio.run(three_calls()))
    assert len(spans) == 3
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
