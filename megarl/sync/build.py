"""Config → a `WeightSyncer` on one trainer rank (the transport and backend resolved)."""

import torch
import torch.distributed as dist

from megarl.config.lora import LoraConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.sync import SyncConfig, chosen_backend, chosen_transport
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import ClientTimeouts
from megarl.engines.client.fleet import Fleet
from megarl.megatron.model import BuiltModel
from megarl.megatron.parallel import RoleGroups
from megarl.sync.adapter import AdapterSyncer
from megarl.sync.executor import WeightSyncer
from megarl.sync.relay import Relay, needs_relay
from megarl.sync.transport import BroadcastTransport, EngineTarget, TensorTransport, Transport


def engine_targets(
    rollout: RolloutConfig, urls: list[str], sites: list[tuple[str, ...]] | None = None
) -> list[EngineTarget]:
    """The replicas at `urls` with their rank counts (an SGLang replica has one rank per TP rank) and,
    when placement was read from Ray, each rank's memory site."""
    ranks = rollout.tensor_parallel_size if rollout.engine == "sglang" else 1
    return [EngineTarget(url, ranks, s) for url, s in zip(urls, sites or [()] * len(urls), strict=True)]


def make_transport(cfg: SyncConfig, kind: str, targets: list[EngineTarget], backend: str, engines: Fleet) -> Transport:
    """`tensor` or `broadcast` to `targets` through `engines`; a broadcast group is named after this rank (one
    group per sender)."""
    if kind == "tensor":
        load_format = None if cfg.tensor_format == "named_tensors" else cfg.tensor_format
        return TensorTransport(targets, engines, load_format)
    if kind == "broadcast":
        name = f"megarl-sync-rank{dist.get_rank()}"
        return BroadcastTransport(targets, name, backend, engines, cfg.timeout_s)
    raise ValueError(f"sync.transport={kind!r}: use tensor, broadcast or auto")


def build_syncer(
    model: BuiltModel,
    groups: RoleGroups,
    cfg: SyncConfig,
    placement: str,
    targets: list[EngineTarget],
    engine_dtype: torch.dtype,
    keys: EngineKeys | None = None,
    rank_sites: tuple[str, ...] = (),
    lora: LoraConfig | None = None,
    ranks_per_engine: int = 1,
) -> WeightSyncer:
    """Collective over the role's ranks (it creates the sync's groups). `rank_sites`: each trainer
    rank's memory site (by rank); with the tensor transport, engine ranks at other sites get their
    handles from a trainer rank at theirs (`sync.relay`). `lora` (a LoRA actor's): `sync=adapter` sends
    its adapter (`AdapterSyncer`, one payload per engine rank: `ranks_per_engine`), `merged` the weights
    with the adapters merged in."""
    on_gpu = next(model.chunks[0].parameters()).is_cuda
    backend = chosen_backend(cfg, "cuda" if on_gpu else "cpu")
    engines = Fleet.connect([t.url for t in targets], keys, ClientTimeouts(control_s=cfg.timeout_s))
    transport = make_transport(cfg, chosen_transport(cfg, placement), targets, backend, engines)
    relay = None
    if isinstance(transport, TensorTransport) and needs_relay(dist.get_world_size(), rank_sites, targets):
        relay = Relay(rank_sites, targets, transport.entry, cfg.timeout_s)
    adapter = lora is not None and lora.sync == "adapter"
    syncer = (AdapterSyncer if adapter else WeightSyncer)(
        model,
        groups,
        targets,
        transport,
        engines,
        engine_dtype=engine_dtype,
        bucket_bytes=cfg.bucket_bytes,
        delta=cfg.delta,
        timeout_s=cfg.timeout_s,
        relay=relay,
        merge_lora=lora is not None and lora.sync == "merged",
    )
    if isinstance(syncer, AdapterSyncer):
        assert lora is not None
        syncer.configure_adapter(lora, ranks_per_engine)
    return syncer
