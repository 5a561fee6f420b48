"""Free TCP ports for servers and rendezvous stores: drawn below the kernel's ephemeral range, never handed out
twice by one process (engine servers, SGLang's NCCL port, the weight-update group's store, the trainer's and
the local launcher's process-group stores)."""

import random
import socket
from contextlib import ExitStack
from pathlib import Path

SERVER_PORTS_START = 20000
"""Server ports are drawn from [SERVER_PORTS_START, the kernel's ephemeral range): above Ray's worker ports
(10002-19999 by default) and below the ports the kernel hands to bind(0) and to every outgoing connection,
one of which could take a port picked there before its server binds it (SGLang keeps the NCCL port it
picks below that range for the same reason: srt/server_args.py::PortArgs.init_new →
srt/utils/network.py::get_free_port_below_ephemeral)."""
DEFAULT_EPHEMERAL_START = 32768
"""Linux's default start of net.ipv4.ip_local_port_range, when it cannot be read."""
MIN_SERVER_PORTS = 1000
"""Below this many ports under the ephemeral range, ports come from the kernel (bind to port 0) instead."""
_handed_out: set[int] = set()
"""Ports this process handed out: not handed out again, as their servers may not have bound them yet."""


def ephemeral_start(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (each held until all are picked), at random below the
    ephemeral range and none handed out before by this process."""
    stop = ephemeral_start()
    if stop - SERVER_PORTS_START < MIN_SERVER_PORTS:
        return _kernel_ports(count, host)
    candidates = [port for port in range(SERVER_PORTS_START, stop) if port not in _handed_out]
    random.shuffle(candidates)
    with ExitStack() as stack:
        picked: list[int] = []
        for port in candidates:
            if _bind(stack, host, port):
                picked.append(port)
            if len(picked) == count:
                _handed_out.update(picked)
                return picked
    raise RuntimeError(f"no {count} free ports on {host} in [{SERVER_PORTS_START}, {stop})")


def _bind(stack: ExitStack, host: str, port: int) -> bool:
    """Bind a socket to `port`, held until `stack` closes; False if the port is taken."""
    s = socket.socket()
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return False
    stack.enter_context(s)
    return True


def _kernel_ports(count: int, host: str) -> list[int]:
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    return free_ports(1, host)[0]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `port` can be bound on `host` right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
