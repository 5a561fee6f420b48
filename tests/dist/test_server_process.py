"""ServerProcess and the Ray node actors, driving a real tiny HTTP server script."""

import logging
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megarl.engines.replicas.replica import ReplicaHandle, launch_replica
from megarl.engines.replicas.server_process import ServerProcess
from megarl.ports import (
    DEFAULT_EPHEMERAL_START,
    MIN_SERVER_PORTS,
    SERVER_PORTS_START,
    ephemeral_start,
    free_port,
    free_ports,
    port_free,
)

# argv: port mode. Modes: ok (healthy after 0.3 s), never (always 503), crash (exits 3 at once),
# spawn (also starts a grandchild and prints its pid), stubborn (ignores SIGTERM).
SERVER = """
import http.server, os, signal, subprocess, sys, time

port, mode = int(sys.argv[1]), sys.argv[2]
print("booting", os.environ.get("MEGARL_TEST_TAG", "-"))
if mode == "crash":
    print("fatal: no model at /nowhere", file=sys.stderr)
    sys.exit(3)
if mode == "spawn":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("grandchild", child.pid)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ready_at = time.monotonic() + 0.3


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and mode != "never" and time.monotonic() >= ready_at
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture(scope="module")
def server_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("server") / "tiny_server.py"
    path.write_text(SERVER)
    return path


def _command(script: Path, port: int, mode: str) -> list[str]:
    return [sys.executable, str(script), str(port), mode]


def _gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_free_ports_lie_below_the_ephemeral_range_bindable_and_never_twice() -> None:
    """Server ports come from below the ports the kernel gives to bind(0) and outgoing connections; two calls
    never hand out one port (its server may not have bound it yet)."""
    stop = ephemeral_start()
    assert stop - SERVER_PORTS_START >= MIN_SERVER_PORTS  # this machine has room below the ephemeral range
    first, second = free_ports(4), [*free_ports(4), free_port()]
    assert len(set(first + second)) == 9
    for port in first + second:
        assert SERVER_PORTS_START <= port < stop
        assert port_free(port) and port_free(port, host="0.0.0.0")


def test_the_ephemeral_range_falls_back_to_linuxs_default(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_start(ranges) == 40000
    assert ephemeral_start(tmp_path / "absent") == DEFAULT_EPHEMERAL_START == 32768


def test_healthy_server_logs_and_stops(server_script: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    log_path = tmp_path / "logs" / "ok.log"
    with caplog.at_level(logging.INFO, logger="megarl.engines.replicas.server_process"):
        server = ServerProcess(_command(server_script, port, "ok"), log_path=log_path, env={"MEGARL_TEST_TAG": "t1"})
        server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
        assert server.alive and server.returncode is None
        assert server.stop(timeout_s=5) == -signal.SIGTERM
    assert not server.alive
    assert server.stop() == -signal.SIGTERM  # a second stop changes nothing
    assert "booting t1" in log_path.read_text()
    assert server.log_tail() == ["booting t1"]
    assert any("booting t1" in record.getMessage() for record in caplog.records)


def test_early_exit_names_command_url_and_log(server_script: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    server = ServerProcess(_command(server_script, port, "crash"), log_path=tmp_path / "crash.log")
    with pytest.raises(RuntimeError) as error:
        server.wait_healthy(url, timeout_s=20)
    message = str(error.value)
    assert "exited with code 3" in message
    assert url in message
    assert str(server_script) in message
    assert "fatal: no model at /nowhere" in message
    assert server.returncode == 3


def test_timeout_names_last_poll(server_script: Path, tmp_path: Path) -> None:
    port = free_port()
    with ServerProcess(_command(server_script, port, "never"), log_path=tmp_path / "never.log") as server:
        start = time.monotonic()
        expected = r"did not answer 200 on http://\S+/health within 1.5 s \(last poll: HTTP 503\)"
        with pytest.raises(RuntimeError, match=expected) as error:
            server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=1.5)
        assert time.monotonic() - start < 5
        assert "booting" in str(error.value)
        assert server.alive  # a timeout leaves the process to the caller
    assert not server.alive


def test_stop_kills_the_whole_process_group(server_script: Path, tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(_command(server_script, port, "spawn"), log_path=tmp_path / "spawn.log")
    server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
    grandchild = int(next(line for line in server.log_tail() if line.startswith("grandchild")).split()[1])
    assert not _gone(grandchild)
    server.stop(timeout_s=5)
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_stop_escalates_to_sigkill(server_script: Path, tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(_command(server_script, port, "stubborn"), log_path=tmp_path / "stubborn.log")
    server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=20)
    assert server.stop(timeout_s=0.5) == -signal.SIGKILL


@pytest.mark.usefixtures("local_ray")
def test_launch_replica_through_node_actor(server_script: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    replica = launch_replica(
        [_command(server_script, port, "ok")],
        url=url,
        health_path="/health",
        log_dir=str(tmp_path),
        env={"MEGARL_TEST_TAG": "ray"},
        timeout_s=30,
        num_cpus=0.5,
    )
    try:
        assert replica.url == url and replica.alive()
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            assert reply.status == 200
    finally:
        replica.stop(timeout_s=5)
    assert Path(replica.log_paths[0]).read_text().startswith("booting ray")


@pytest.mark.usefixtures("local_ray")
def test_replica_fails_when_a_follower_node_exits(server_script: Path, tmp_path: Path) -> None:
    port0, port1 = free_ports(2)
    replica = ReplicaHandle.create(2, num_cpus=0.5)
    try:
        assert len(replica.node_ips()) == 2
        commands = [_command(server_script, port0, "never"), _command(server_script, port1, "crash")]
        replica.start(commands, url=f"http://127.0.0.1:{port0}", log_dir=str(tmp_path))
        with pytest.raises(RuntimeError, match="node 1 of the replica .* exited with code 3") as error:
            replica.wait_healthy("/health", timeout_s=30, check_interval_s=0.2)
        assert "fatal: no model at /nowhere" in str(error.value)
    finally:
        replica.stop(timeout_s=5)


def test_keys_on_the_command_line_never_reach_the_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server started with --api-key/--admin-api-key that prints its arguments (SGLang logs its server_args):
    the keys are masked in the log file, the logger's lines, the tail and the start-up error."""
    keys = ("api-k3y-value", "admin-k3y-value")
    script = "import sys; print('server_args', sys.argv[1:]); sys.exit(3)"
    command = [sys.executable, "-c", script, "--api-key", keys[0], "--admin-api-key", keys[1]]
    log_path = tmp_path / "keyed.log"
    with caplog.at_level(logging.INFO, logger="megarl.engines.replicas.server_process"):
        server = ServerProcess(command, log_path=log_path)
        with pytest.raises(RuntimeError) as error:
            server.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout_s=20)
    shown = [log_path.read_text(), str(error.value), *server.log_tail(), *(r.getMessage() for r in caplog.records)]
    assert "server_args" in shown[0] and "--api-key <redacted>" in str(error.value)
    assert not [text for text in shown for key in keys if key in text]
