"""Transports: how one packed bucket reaches every replica. One interface, two implementations.

- `TensorTransport` (colocated): the bucket lives in memory the engine can map (named shared
  memory on CPU, the device itself on GPU); the engine gets handles via `update_weights_from_tensor`
  (one for the whole bucket with load_format=flattened_bucket, else one per tensor) and copies
  straight out of the sender's buffer.
- `BroadcastTransport` (separate pools): each sender owns a gloo/NCCL group with every engine rank
  (`init_weights_update_group`) and broadcasts the bucket as one flat buffer
  (`update_weights_from_distributed`, load_format=flattened_bucket).

Transports run on the sender's event loop thread and reach the engines through the executor's `Fleet`; every
engine call has the client's control timeout and every group operation `timeout_s`.
"""

import asyncio
import socket
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megarl.engines.client.fleet import Fleet
from megarl.engines.replicas.sglang_command import ALL_INTERFACES, LOOPBACK
from megarl.engines.weights.tensor_handles import (
    LOAD_FORMATS,
    file_system_sharing,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megarl.engines.weights.weight_group import broadcast, close_weight_group, init_weight_group
from megarl.ports import free_port


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One replica: its URL and how many ranks (TP size) it has."""

    url: str
    ranks: int = 1
    sites: tuple[str, ...] = ()
    """Each rank's memory site (`engines.replicas.placement.memory_site`) when placement was read from Ray; a
    handle must come from a trainer rank at the same site. () = every trainer rank's handles open there."""


HeldEntries = dict[tuple[int, int], str]
"""Serialized entries other trainer ranks made for (target index, engine rank) (see `sync.relay`)."""


class Transport(Protocol):
    serialized: bool
    """True when buckets of different senders must not be in flight at once (collectives)."""

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def sends_in_place(self, device: torch.device) -> bool:
        """Whether any tensor on `device` (e.g. a parameter) can be sent without a copy into `allocate`d memory."""
        ...

    def peers_can_write(self, device: torch.device) -> bool:
        """Whether other trainer ranks on this machine can map `allocate`d memory and write into it (`sync.peers`)."""
        ...

    def buffers(self, device: torch.device) -> int:
        """How many bucket buffers a sender rotates: with two it packs one while the other is in flight."""
        ...

    async def open(self) -> None: ...

    async def send(
        self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]], held: HeldEntries | None = None
    ) -> None: ...

    async def close(self) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16", the form the engine's update requests take."""
    return str(dtype).removeprefix("torch.")


class TensorTransport:
    """Handles, not copies: the engine maps the sender's bucket and copies each view out of it."""

    serialized = False

    def __init__(self, targets: list[EngineTarget], engines: Fleet, load_format: str | None) -> None:
        """`engines.clients[i]` reaches `targets[i]`."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"TensorTransport load_format={load_format!r}: use one of {LOAD_FORMATS}")
        self.targets = targets
        self.load_format = load_format
        self.engines = engines

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        size = numel * torch.empty((), dtype=dtype).element_size()
        with file_system_sharing():
            storage = torch.UntypedStorage._new_shared(size)
        return torch.empty(0, dtype=torch.uint8).set_(storage).view(dtype)

    def sends_in_place(self, device: torch.device) -> bool:
        return device.type == "cuda"  # a CPU tensor must first be in shared memory

    def peers_can_write(self, device: torch.device) -> bool:
        # Named shared memory only. On GPUs a TP peer holds another GPU, where a CUDA IPC handle to the
        # owner's bucket does not open (peer access is not a given, see sync/relay.py), so CUDA buckets keep
        # the NCCL gather into the owner, which runs at device bandwidth.
        return device.type == "cpu"

    def buffers(self, device: torch.device) -> int:
        # On CPU the engine copies out of host memory on the cores and memory bus that pack the next bucket, so
        # overlapping buys little (none on 2 cores, bench/sync.py). A receiver maps a buffer afresh, page faults
        # and all, unless it still holds its mapping from the previous bucket (torch's `rebuild_storage_filename`
        # reuses a live one; the embedded engine holds it until its next call): two alternating buffers cost
        # it that at every bucket (142.7 MB in 3 buckets: 41 ms instead of 27), one buffer only once per sync.
        return 1 if device.type == "cpu" else 2

    async def open(self) -> None:
        pass

    def entry(self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> str:
        """One engine rank's entry for the bucket `flat` (whose views are `named`), in this transport's format.

        One serialization per receiving rank: each adds the one shared-memory reference that a
        receiver's open consumes. Reusing one entry for several receivers lets the later ones
        consume the sender's own reference, and torch unlinks the (kept) buffer under it.
        """
        if self.load_format == "flattened_bucket":
            return serialize_flattened_bucket(flat, named)
        return serialize_named_tensors(named)

    async def send(
        self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]], held: HeldEntries | None = None
    ) -> None:
        """Every engine rank gets its `held` entry (a copy on another trainer rank), else one of `flat`."""
        held = held or {}

        def entries(t: int, target: EngineTarget) -> list[str]:
            return [held[(t, i)] if (t, i) in held else self.entry(flat, named) for i in range(target.ranks)]

        await asyncio.gather(
            *(
                client.update_weights_from_tensor(entries(t, target), load_format=self.load_format, flush_cache=False)
                for t, (client, target) in enumerate(zip(self.engines.clients, self.targets, strict=True))
            )
        )

    async def close(self) -> None:
        pass


def group_host(targets: list[EngineTarget]) -> str:
    """The address engines reach this sender at: loopback when every engine is local, else this host's
    address on the interface that routes to the first remote engine (a UDP connect sends nothing).

    Not `gethostbyname(gethostname())`: on stock Ubuntu that is 127.0.1.1, which a remote engine
    would take for its own loopback.
    """
    hosts = {urlparse(t.url).hostname or LOOPBACK for t in targets}
    remote = sorted(hosts - {LOOPBACK, "localhost"})
    if not remote:
        return LOOPBACK
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((remote[0], 9))
        return str(probe.getsockname()[0])


class BroadcastTransport:
    """One weight-update group per sender: the sender is rank 0, replica r's ranks follow."""

    serialized = True

    def __init__(
        self,
        targets: list[EngineTarget],
        group_name: str,
        backend: str,
        engines: Fleet,
        timeout_s: float,
    ) -> None:
        """`engines.clients[i]` reaches `targets[i]`."""
        self.targets = targets
        self.group_name = group_name
        self.backend = backend
        self.engines = engines
        self._timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def sends_in_place(self, device: torch.device) -> bool:
        return True

    def peers_can_write(self, device: torch.device) -> bool:
        return False  # a private buffer, broadcast by its owner

    def buffers(self, device: torch.device) -> int:
        return 2

    async def open(self) -> None:
        host = group_host(self.targets)
        port = free_port(LOOPBACK if host == LOOPBACK else ALL_INTERFACES)  # the store listens on every interface
        world = 1 + sum(t.ranks for t in self.targets)
        offsets = [1 + sum(t.ranks for t in self.targets[:i]) for i in range(len(self.targets))]
        joins = [
            client.init_weights_update_group(host, port, offset, world, self.group_name, self.backend)
            for client, offset in zip(self.engines.clients, offsets, strict=True)
        ]
        local = asyncio.to_thread(
            init_weight_group, host, port, 0, world, self.group_name, self.backend, self._timeout_s
        )
        self._group, *_ = await asyncio.gather(local, *joins)

    async def send(
        self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]], held: HeldEntries | None = None
    ) -> None:
        assert self._group is not None, "send before open"
        assert not held, "a broadcast reaches every engine rank from the sender; nothing is held elsewhere"
        group, dtype = self._group, dtype_name(flat.dtype)
        requests = [
            asyncio.ensure_future(
                client.update_weights_from_distributed(
                    [n for n, _ in named],
                    [dtype] * len(named),
                    [list(t.shape) for _, t in named],
                    group_name=self.group_name,
                    flush_cache=False,
                    load_format="flattened_bucket",
                )
            )
            for client in self.engines.clients
        ]
        await asyncio.to_thread(broadcast, group, flat.view(torch.uint8))
        await asyncio.gather(*requests)

    async def close(self) -> None:
        """Every engine leaves the group; one that is not in it (restarted since it joined) is left as it is."""
        if self._group is not None:
            leaving = (c.destroy_weights_update_group(self.group_name) for c in self.engines.clients)
            await asyncio.gather(*leaving, return_exceptions=True)
            close_weight_group(self._group)
            self._group = None
