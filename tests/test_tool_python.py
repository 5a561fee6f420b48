"""`PythonTool`: output, errors, timeout, memory limit, network guard, truncation, config and concurrency."""

import asyncio
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megarl.agents.tools.base import ToolResult
from megarl.agents.tools.python_exec import PythonTool, _network_namespace_argv

SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}


def make_tool(**config: Any) -> PythonTool:
    return PythonTool(config, SCHEMA)


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


def test_network_namespace_blocks_raw_sockets(listener: socket.socket) -> None:
    if not asyncio.run(_network_namespace_argv(sys.executable)):
        pytest.skip("unshare --user --net does not work on this machine")
    port = listener.getsockname()[1]
    code = f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected!')"
    result = run(make_tool(), code)
    assert "OSError" in result.text
    assert "connected!" not in result.text
    assert_no_connection(listener)


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
        ({"timeout": 5}, "timeout"),
    ],
)
def test_bad_config_names_the_key(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"config\.{key}\b"):
        PythonTool(config, SCHEMA)


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


def test_concurrency_limit_is_honored(tmp_path: Path) -> None:
    """With max_concurrency=1 no two calls hold the lock file at once (O_EXCL would fail for the second)."""
    lock = tmp_path / "lock"
    code = (
        "import os, time\n"
        f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"
        "time.sleep(0.2)\n"
        f"os.remove({str(lock)!r})\n"
        "print('ok')"
    )
    tool = make_tool(max_concurrency=1)

    async def three_calls() -> list[ToolResult]:
        return await asyncio.gather(*(tool.execute(f"trajectory-{i}", {"code": code}) for i in range(3)))

    assert [result.text for result in asyncio.run(three_calls())] == ["ok"] * 3
    assert not os.path.exists(lock)
