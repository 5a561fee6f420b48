"""One rollout replica on Ray: an `EngineNodeActor` per node, each running that node's server process.

Generic over the command: the same code starts SGLang on GPU nodes and the CPU embedded engine.

A replica whose commands do not depend on where its actors land (one node, a fixed address)::

    replica = launch_replica([command], url="http://127.0.0.1:8000", health_path="/health", log_dir="logs")
    ...
    replica.stop()

A multi-node SGLang replica needs node 0's address and free ports before the commands exist; one
`PortLedger` across all replicas keeps two replicas (or two node ranks) from being handed one port
while the first server has not bound it yet::

    ledger = PortLedger()
    replica = ReplicaHandle.create(2, placement_group=pg, bundle_indices=[0, 1])
    try:
        ips = replica.node_ips()
        port, dist_port = replica.reserve_ports(2, ledger)
        per_node = replica_node_args(base, layout, 0, ips, port, dist_port)
        replica.start([sglang_command(a) for a in per_node], url=server_url(per_node[0], ips[0]), log_dir="logs")
        replica.wait_healthy(HEALTH_PATH, timeout_s=900)
    except BaseException:
        replica.stop()
        raise
"""

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megarl.engines.replicas.server_process import ServerProcess
from megarl.ports import free_ports, port_free

ActorHandle = Any  # ray.actor.ActorHandle; Ray ships no type information
_PORT_TRIES = 20


class PortLedger:
    """The ports handed out per node address during one launch.

    A picked port stays free until its server binds it, which for SGLang comes after the weights
    load; without the ledger a later replica on the same node could be handed the same port.
    """

    def __init__(self) -> None:
        self._taken: dict[str, set[int]] = {}

    def taken(self, addresses: list[str]) -> set[int]:
        return set().union(*(self._taken.get(a, set()) for a in addresses))

    def add(self, addresses: list[str], ports: list[int]) -> None:
        for address in addresses:
            self._taken.setdefault(address, set()).update(ports)


class EngineNodeActor:
    """Holds the server process of one node of a replica.

    A plain class made an actor by `ReplicaHandle.create` (`ray.remote(EngineNodeActor).options(...)`):
    the caller picks its resources and placement per replica, and the class stays importable and
    type-checked without Ray. It runs threaded (max_concurrency > 1) so `alive` and `stop` answer
    while `wait_healthy` is polling.
    """

    def __init__(self) -> None:
        self._server: ServerProcess | None = None

    def node_ip(self) -> str:
        return str(ray.util.get_node_ip_address())

    def free_ports(self, count: int, exclude: list[int]) -> list[int]:
        """`count` ports free on every interface of this node, none of them in `exclude`."""
        for _ in range(_PORT_TRIES):
            ports = free_ports(count, host="0.0.0.0")
            if not set(ports) & set(exclude):
                return ports
        raise RuntimeError(f"no {count} free ports outside the {len(exclude)} already handed out on this node")

    def ports_free(self, ports: list[int]) -> bool:
        """Whether every port of `ports` can be bound on every interface of this node right now."""
        return all(port_free(port, host="0.0.0.0") for port in ports)

    def start(self, command: list[str], env: dict[str, str], log_path: str) -> int:
        """Start `command` (env overrides on top of this worker's environment); returns its pid."""
        if self._server is not None and self._server.alive:
            raise RuntimeError(f"a server is already running here (pid {self._server.pid}); stop it first")
        self._server = ServerProcess(command, log_path=log_path, env=env)
        return self._server.pid

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        self._started().wait_healthy(url, timeout_s)

    def alive(self) -> bool:
        return self._server is not None and self._server.alive

    def returncode(self) -> int | None:
        return self._started().returncode

    def log_tail(self) -> list[str]:
        return self._started().log_tail()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the server's whole process group; its exit status, or None if none was started."""
        return None if self._server is None else self._server.stop(timeout_s)

    def _started(self) -> ServerProcess:
        if self._server is None:
            raise RuntimeError("no server started on this node; call start() first")
        return self._server


class ReplicaHandle:
    """Driver-side handle on the node actors of one replica; node 0 serves the API at `url`."""

    def __init__(self, actors: list[ActorHandle]) -> None:
        self.actors = actors
        self.url: str | None = None
        self.log_paths: list[str] = []
        self._launch: list[tuple[list[str], dict[str, str]]] = []
        """(command, environment) of each node, as `start` last ran them."""

    @classmethod
    def create(
        cls,
        num_nodes: int,
        *,
        placement_group: PlacementGroup | None = None,
        bundle_indices: list[int] | None = None,
        node_ids: list[str] | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
    ) -> "ReplicaHandle":
        """One `EngineNodeActor` per node, node 0 first.

        Placement: bundle `bundle_indices[r]` of `placement_group` (default: bundle r), or the Ray
        node `node_ids[r]`, or wherever Ray likes. With num_gpus=0 the actor holds no device; pass
        the server its devices through `start(env=...)` (e.g. CUDA_VISIBLE_DEVICES).
        """
        if placement_group is not None and node_ids is not None:
            raise ValueError("give either placement_group (with bundle_indices) or node_ids, not both")
        if bundle_indices is not None and placement_group is None:
            raise ValueError("bundle_indices needs placement_group")
        if placement_group is not None:
            indices = list(range(num_nodes)) if bundle_indices is None else bundle_indices
            strategies: list[Any] = [PlacementGroupSchedulingStrategy(placement_group, i) for i in indices]
        elif node_ids is not None:
            strategies = [NodeAffinitySchedulingStrategy(node_id, soft=False) for node_id in node_ids]
        else:
            strategies = ["DEFAULT"] * num_nodes
        if len(strategies) != num_nodes:
            raise ValueError(f"{num_nodes} nodes but {len(strategies)} bundle indices or node ids")
        actor_cls = ray.remote(EngineNodeActor)
        options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 4}
        return cls([actor_cls.options(**options, scheduling_strategy=s).remote() for s in strategies])

    def node_ips(self) -> list[str]:
        """Each node's IP address, node 0 first."""
        return list(ray.get([actor.node_ip.remote() for actor in self.actors]))

    def reserve_ports(self, count: int, ledger: PortLedger) -> list[int]:
        """`count` distinct ports free on every node of this replica and not in `ledger` for any of them.

        Every node needs them: SGLang's nodes >= 1 bind the API port too, for their health stub
        (utils/common.py::launch_dummy_health_check_server). The ports are recorded in `ledger`.
        """
        ips = self.node_ips()
        for _ in range(_PORT_TRIES):
            ports = list(ray.get(self.actors[0].free_ports.remote(count, sorted(ledger.taken(ips)))))
            if all(ray.get([actor.ports_free.remote(ports) for actor in self.actors[1:]])):
                ledger.add(ips, ports)
                return ports
        raise RuntimeError(f"found no {count} ports free on all {len(ips)} nodes {ips} in {_PORT_TRIES} tries")

    def start(
        self,
        commands: list[list[str]],
        *,
        url: str,
        log_dir: str,
        env: Mapping[str, str] | None = None,
        node_envs: list[dict[str, str]] | None = None,
    ) -> None:
        """Start commands[r] on node r, logging to `log_dir`/node<r>.log on that node; node 0 will serve `url`.

        `env` overrides the environment on every node, `node_envs[r]` on node r (on top of `env`).
        """
        if len(commands) != len(self.actors) or (node_envs is not None and len(node_envs) != len(commands)):
            raise ValueError(f"{len(commands)} commands (and node_envs) for a replica of {len(self.actors)} node(s)")
        envs = [dict(env or {}) | (node_envs[r] if node_envs else {}) for r in range(len(commands))]
        self.url = url
        self.log_paths = [str(Path(log_dir) / f"node{rank}.log") for rank in range(len(commands))]
        self._launch = list(zip(commands, envs, strict=True))
        self._start_servers()

    def _start_servers(self) -> None:
        launches = zip(self.actors, self._launch, self.log_paths, strict=True)
        ray.get([actor.start.remote(command, env, path) for actor, (command, env), path in launches])

    def restart(self, health_path: str, timeout_s: float, stop_timeout_s: float = 5.0) -> None:
        """Stop every node's server (SIGTERM; SIGKILL after `stop_timeout_s`, which also ends a stopped or hung
        one), start the same commands on the same nodes and ports again (logs continue in the same files), and
        wait until node 0 answers `health_path`."""
        ray.get([actor.stop.remote(stop_timeout_s) for actor in self.actors])
        self._start_servers()
        self.wait_healthy(health_path, timeout_s)

    def log_tail(self) -> list[str]:
        """The last log lines of node 0's server."""
        return list(ray.get(self.actors[0].log_tail.remote()))

    def wait_healthy(self, health_path: str, timeout_s: float, *, check_interval_s: float = 1.0) -> None:
        """Wait until node 0 answers 200 on `health_path`, checking meanwhile that the other nodes still run.

        Nodes >= 1 are only checked for being alive (SGLang's stub on them always answers 200).
        Raises RuntimeError (with the failing node's last log lines) on an exit or the timeout.
        """
        if self.url is None:
            raise RuntimeError("the replica was not started; call start() first")
        url = self.url + health_path
        healthy = self.actors[0].wait_healthy.remote(url, timeout_s)
        while not ray.wait([healthy], timeout=check_interval_s)[0]:
            for rank, actor in enumerate(self.actors[1:], start=1):
                if not ray.get(actor.alive.remote()):
                    code, tail = ray.get([actor.returncode.remote(), actor.log_tail.remote()])
                    lines = "\n".join(f"    {line}" for line in tail) or "    (no output)"
                    raise RuntimeError(
                        f"node {rank} of the replica at {self.url} exited with code {code} while waiting for {url}\n"
                        f"  last log lines ({self.log_paths[rank]} on that node):\n{lines}"
                    )
        ray.get(healthy)

    def alive(self) -> bool:
        """Whether the server process of every node is running."""
        return all(ray.get([actor.alive.remote() for actor in self.actors]))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every node's server (SIGTERM, then SIGKILL after `timeout_s`) and end the actors."""
        stops = [actor.stop.remote(timeout_s) for actor in self.actors]
        for ref in stops:
            with contextlib.suppress(RayActorError):  # the actor is already gone: nothing left to ask it
                ray.get(ref)
        for actor in self.actors:
            ray.kill(actor)


def launch_replica(
    commands: list[list[str]],
    *,
    url: str,
    health_path: str,
    log_dir: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    placement_group: PlacementGroup | None = None,
    bundle_indices: list[int] | None = None,
    node_ids: list[str] | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
) -> ReplicaHandle:
    """Create one actor per command, start them all and wait until node 0 is healthy at `url` + `health_path`.

    On any failure every node is stopped before the error propagates.
    """
    replica = ReplicaHandle.create(
        len(commands),
        placement_group=placement_group,
        bundle_indices=bundle_indices,
        node_ids=node_ids,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
    )
    try:
        replica.start(commands, url=url, log_dir=log_dir, env=env)
        replica.wait_healthy(health_path, timeout_s)
    except BaseException:
        replica.stop()
        raise
    return replica
