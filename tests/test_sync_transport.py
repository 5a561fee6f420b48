"""Where a broadcast sender says engines can reach it."""

import ray

from megarl.engines.sglang_command import LOOPBACK
from megarl.sync.transport import EngineTarget, group_host


def test_local_engines_reach_the_sender_on_loopback() -> None:
    assert group_host([EngineTarget("http://127.0.0.1:30000"), EngineTarget("http://localhost:30001")]) == LOOPBACK


def test_remote_engines_get_a_routable_address_not_a_loopback_one() -> None:
    node_ip = str(ray.util.get_node_ip_address())  # this machine's routable address, as Ray reports it
    assert not node_ip.startswith("127.")
    host = group_host([EngineTarget("http://127.0.0.1:30000"), EngineTarget(f"http://{node_ip}:30000")])
    assert host == node_ip
