"""Per-rank functions for the weight-sync tests and bench: Megatron ranks syncing into real engines."""

import asyncio
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cases.engine_cases import engine_client
from cases.megatron_cases import sample_batch, with_training_columns
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.sync import SyncConfig
from megarl.config.training import OptimConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.sampling import SamplingParams
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.losses import PolicyLoss
from megarl.megatron.model import build_model
from megarl.megatron.optim import make_trainable
from megarl.megatron.parallel import ParallelLayout, build_role_groups
from megarl.megatron.weights import SafetensorsReader, load_hf_weights, named_weights
from megarl.models.spec import load_hf_config, model_spec
from megarl.sync.build import build_syncer
from megarl.sync.executor import WeightSyncer
from megarl.sync.metrics import SyncMetrics
from megarl.sync.transport import EngineTarget
from megarl.workers.base import RankWorker

if TYPE_CHECKING:
    from megarl.sync.sequence import ColocatedSequence

PROMPTS = [[5, 17, 42, 9, 77], [101, 3, 64, 8, 12], [7, 7, 200, 31, 2]]
NEW_TOKENS = 6
SGD = OptimConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_grad=100.0)
ADAM = OptimConfig(name="adam", lr=1e-2, weight_decay=0.0, clip_grad=100.0)


@dataclass(frozen=True, slots=True)
class Replicas:
    """Engine URLs per transport: `tensor` replicas get handles, `broadcast` replicas a group."""

    tensor: list[str]
    broadcast: list[str]


async def _engine_samples(url: str) -> list[tuple[list[int], list[float], str]]:
    client = engine_client(url)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, sampling_seed=3)
    try:
        results = await asyncio.gather(*(client.generate(p, sampling, return_logprob=True) for p in PROMPTS))
    finally:
        await client.close()
    return [(r[0].output_ids, r[0].output_logprobs, r[0].weight_version) for r in results]


def engine_samples(url: str) -> list[tuple[list[int], list[float], str]]:
    """Rank 0 samples PROMPTS from the engine at `url`; every rank gets (output ids, log-probs, weight version)."""
    box: list = [asyncio.run(_engine_samples(url)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sample_gap(engine: MegatronEngine, samples: list[tuple[list[int], list[float], str]]) -> float:
    """max |engine log-prob − trainer log-prob| over the engine's samples."""
    responses = torch.tensor([ids for ids, _, _ in samples])
    batch = {
        "input_ids": torch.cat([torch.tensor(PROMPTS), responses], dim=1),
        "attention_mask": torch.ones(len(PROMPTS), len(PROMPTS[0]) + NEW_TOKENS, dtype=torch.long),
        "responses": responses,
        "response_mask": torch.ones_like(responses),
    }
    trainer = engine.forward(batch, MicroBatching(micro_batch_size=len(PROMPTS)))["log_probs"]
    return (trainer - torch.tensor([lp for _, lp, _ in samples])).abs().max().item()


def log_prob_gap(engine: MegatronEngine, url: str) -> tuple[float, str]:
    """The gap on the engine's own samples of PROMPTS, and the engine's weight version."""
    samples = engine_samples(url)
    return sample_gap(engine, samples), samples[0][2]


def _syncers(
    model: object,
    groups: object,
    replicas: Replicas,
    bucket_bytes: int,
    broadcast_backend: str = "auto",
    engine_dtype: torch.dtype = torch.float32,
    keys: EngineKeys | None = None,
) -> dict[str, WeightSyncer]:
    out = {}
    for kind, urls in (("tensor", replicas.tensor), ("broadcast", replicas.broadcast)):
        if urls:
            cfg = SyncConfig(transport=kind, bucket_bytes=bucket_bytes, backend=broadcast_backend)
            targets = [EngineTarget(u) for u in urls]
            out[kind] = build_syncer(model, groups, cfg, "colocated", targets, engine_dtype, keys)  # type: ignore[arg-type]
    return out


def _trainer(model_dir: Path, role_layout: ParallelLayout, optim: OptimConfig = ADAM) -> tuple:
    """(spec, groups, model, trainable, engine) of a role loaded from `model_dir`."""
    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(role_layout)
    model = build_model(spec, groups)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    trainable = make_trainable(model, groups, optim, False, total_steps=10)
    return spec, groups, model, trainable, MegatronEngine(model, groups, trainable)


def _train_step(engine: MegatronEngine, vocab_size: int, seed: int) -> None:
    batch = with_training_columns(sample_batch(vocab_size, num_rows=4, seed=seed))
    batch["old_log_probs"] = engine.forward(batch, MicroBatching(micro_batch_size=4))["log_probs"]
    engine.train_step(batch, MicroBatching(micro_batch_size=4), PolicyLoss(AlgorithmConfig()))


def rank_sync_twice(
    model_dir: Path, role_layout: ParallelLayout, replicas: Replicas, bucket_bytes: int, broadcast_backend: str = "auto"
) -> dict[str, object]:
    """Sync (both transports), check every replica, take one training step, check the replicas are
    stale, sync again, check again. Returns gaps per (round, url) and the metrics per round."""
    spec, groups, model, _, engine = _trainer(model_dir, role_layout, SGD)
    syncers = _syncers(model, groups, replicas, bucket_bytes, broadcast_backend)
    urls = replicas.tensor + replicas.broadcast
    gaps: dict[str, float] = {}
    versions: dict[str, str] = {}
    metrics: dict[str, SyncMetrics] = {}
    for round_ in (1, 2):
        if round_ == 2:
            _train_step(engine, spec.vocab_size, seed=0)
            for url in urls:
                gaps[f"stale/{url}"] = log_prob_gap(engine, url)[0]
        for kind, syncer in syncers.items():
            metrics[f"{round_}/{kind}"] = syncer.sync(weight_version=f"v{round_}")
        for url in urls:
            gaps[f"{round_}/{url}"], versions[f"{round_}/{url}"] = log_prob_gap(engine, url)
    for syncer in syncers.values():
        syncer.close()
    return {"gaps": gaps, "versions": versions, "metrics": metrics}


def rank_expert_bias_sync(
    model_dir: Path, role_layout: ParallelLayout, replicas: Replicas, keys: EngineKeys
) -> dict[str, object]:
    """Set every router's expert bias to fp32 values bf16 cannot hold, sync into bf16 engines that take `keys`; the
    trainer's biases and each engine's (read back by name), by HF name."""
    _, groups, model, _, _ = _trainer(model_dir, role_layout, SGD)
    biases = {n: b for n, b in named_weights(model.chunks[0]) if n.endswith(".router.expert_bias")}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bias in biases.values():
            bias.copy_(1 + 1e-3 * torch.rand(bias.shape, generator=generator))  # bf16 keeps 8 bits: steps of 2^-7
    syncers = _syncers(model, groups, replicas, 2**20, engine_dtype=torch.bfloat16, keys=keys)
    for syncer in syncers.values():
        syncer.sync()
    hf = {n.replace("decoder.", "model.").replace("router.expert_bias", "gate.e_score_correction_bias"): b.clone()
          for n, b in biases.items()}  # fmt: skip
    engines = {}
    if dist.get_rank() == 0:
        for url in replicas.tensor + replicas.broadcast:
            engines[url] = {name: asyncio.run(_read_weight(url, name, keys)) for name in hf}
    for syncer in syncers.values():
        syncer.close()
    return {"trainer": hf, "engines": engines}


async def _read_weight(url: str, name: str, keys: EngineKeys) -> torch.Tensor:
    client = engine_client(url, keys)
    try:
        return torch.tensor(await client.get_weights_by_name(name), dtype=torch.float32)
    finally:
        await client.close()


def _count_point_to_point(counts: dict[str, int]) -> None:
    """From now on, add the bytes of every point-to-point send and receive of this process to `counts["bytes"]`."""
    for name in ("send", "recv", "isend", "irecv"):
        op = getattr(dist, name)

        def counted(tensor: torch.Tensor, *args: object, _op: Callable = op, **kwargs: object) -> object:
            counts["bytes"] += tensor.numel() * tensor.element_size()
            return _op(tensor, *args, **kwargs)

        setattr(dist, name, counted)


def rank_peer_writes(model_dir: Path, role_layout: ParallelLayout, url: str, bucket_bytes: int) -> dict[str, object]:
    """Two tensor syncs (a training step between): the point-to-point bytes this rank moved during each, the
    engine's gap before (stale) and after each, and the plan's sizes."""
    spec, groups, model, _, engine = _trainer(model_dir, role_layout, SGD)
    syncer = _syncers(model, groups, Replicas(tensor=[url], broadcast=[]), 2**20)["tensor"]
    syncer.bucket_bytes = bucket_bytes  # below the config's minimum: the largest tensors get buckets of their own
    plan, _ = syncer.plan()
    counts = {"bytes": 0}
    _count_point_to_point(counts)
    out: dict[str, list[float]] = {"p2p": [], "gaps": [], "stale": []}
    for round_ in (1, 2):
        if round_ == 2:
            _train_step(engine, spec.vocab_size, seed=0)
        out["stale"].append(log_prob_gap(engine, url)[0])
        counts["bytes"] = 0
        syncer.sync(weight_version=f"v{round_}")
        out["p2p"].append(counts["bytes"])
        out["gaps"].append(log_prob_gap(engine, url)[0])
    syncer.close()
    return {**out, "total": plan.total_bytes, "largest": plan.largest_tensor_bytes}


def _peak_rss_reset() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rank_sync_memory(model_dir: Path, role_layout: ParallelLayout, url: str, bucket_bytes: int) -> dict[str, int]:
    """A second tensor-transport sync; this rank's peak RSS above its RSS before it, and the plan's sizes."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(role_layout)
    model = build_model(spec, groups)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    syncer = _syncers(model, groups, Replicas(tensor=[url], broadcast=[]), bucket_bytes)["tensor"]
    plan, _ = syncer.plan()
    syncer.sync()  # the first sync also starts the engine session, the shm manager and the event loop
    syncer.release_buffers()  # measure the buffers too
    dist.barrier()
    before = _peak_rss_reset()
    metrics = syncer.sync()
    peak = _status_kib("VmHWM") - before
    syncer.close()
    return {
        "peak_rss_extra": peak,
        "accounted": metrics.peak_extra_bytes,
        "largest": plan.largest_tensor_bytes,
        "total": plan.total_bytes,
        "buckets": metrics.buckets,
        "owner": int(dist.get_rank() in plan.owners),
    }


def _record_handover(sequence: "ColocatedSequence", events: list[str]) -> None:
    """Append to `events`, in order: the sequence's offloads, its engine calls, and each full garbage collection
    (`free_cached_memory` starts with one)."""

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            events.append(name or args[0])  # an engine call: its step
            return fn(*args)

        return call

    sequence.state.offload = recorded("offload state", sequence.state.offload)  # type: ignore[method-assign]
    sequence.params.offload = recorded("offload params", sequence.params.offload)  # type: ignore[method-assign]
    sequence.syncer.call_engines = recorded("", sequence.syncer.call_engines)  # type: ignore[method-assign]
    gc.callbacks.append(lambda phase, info: events.append("gc") if (phase, info["generation"]) == ("stop", 2) else None)


async def _release_at_start(url: str) -> None:
    """What the driver does at a colocated start-up (`trainer/build.py`): the engine releases `TRAINING_TAGS`."""
    from megarl.engines.client.client import ClientTimeouts
    from megarl.engines.client.fleet import Fleet
    from megarl.sync.sequence import TRAINING_TAGS

    engines = Fleet.connect([url], EngineKeys(), ClientTimeouts(control_s=60))
    try:
        await engines.release(TRAINING_TAGS)
    finally:
        await engines.close()


def rank_colocated_cycles(model_dir: Path, role_layout: ParallelLayout, url: str) -> dict[str, object]:
    """The trainer's start-up order (the engine releases its memory, then the trainer builds), then two
    train → to_rollout → sample → to_training cycles through `ColocatedSequence`; each to_rollout's hand-over
    events (`_record_handover`, with automatic garbage collection off) and memory metrics."""
    from megarl.engines.client.client import ClientTimeouts, EngineError
    from megarl.engines.client.fleet import Fleet
    from megarl.megatron.offload import resident_bytes
    from megarl.sync.sequence import TRAINING_TAGS, ColocatedSequence

    if dist.get_rank() == 0:
        asyncio.run(Fleet.connect([url], EngineKeys(), ClientTimeouts(control_s=60)).release(TRAINING_TAGS))
    dist.barrier()
    spec, groups, model, trainable, engine = _trainer(model_dir, role_layout)
    syncer = _syncers(model, groups, Replicas(tensor=[url], broadcast=[]), 2**20)["tensor"]
    sequence = ColocatedSequence(syncer, trainable, engine_keeps_weights=False)
    out: dict[str, list] = {"gaps": [], "resident_in_rollout": [], "handovers": []}
    events: list[str] = []
    _record_handover(sequence, events)
    for cycle in (1, 2):
        _train_step(engine, spec.vocab_size, seed=cycle)
        before = resident_bytes(trainable)
        events.clear()
        gc.disable()
        metrics = sequence.to_rollout(weight_version=f"c{cycle}")
        gc.enable()
        out["handovers"].append((list(events), dict(sequence.memory)))
        out["resident_in_rollout"].append((before, resident_bytes(trainable)))
        samples = engine_samples(url)
        sequence.to_training()
        out["gaps"].append((sample_gap(engine, samples), samples[0][2], metrics.bytes))
    asleep_error = ""
    if dist.get_rank() == 0:
        try:
            asyncio.run(_engine_samples(url))
        except EngineError as e:
            asleep_error = str(e)
    syncer.close()
    return out | {"asleep_error": asleep_error, "timings": sorted(sequence.timings)}


def rank_delta_sync(model_dir: Path, role_layout: ParallelLayout, url: str) -> dict[str, object]:
    """Delta syncs: everything, then after changing one parameter, then after no change."""
    _, groups, model, _, engine = _trainer(model_dir, role_layout)
    cfg = SyncConfig(transport="tensor", bucket_bytes=2**20, delta=True)
    syncer = build_syncer(model, groups, cfg, "colocated", [EngineTarget(url)], torch.float32)
    metrics = [syncer.sync()]
    with torch.no_grad():
        model.chunks[0].decoder.layers[0].self_attention.linear_proj.weight.add_(0.05)
    metrics.append(syncer.sync())
    gap = log_prob_gap(engine, url)[0]
    metrics.append(syncer.sync())
    first_plan = syncer.plan()[0]
    syncer.bucket_bytes = 2**21  # a changed layout: the plan is rebuilt and the transports reopened
    metrics.append(syncer.sync(full=True))
    replanned = syncer.plan()[0] is not first_plan and syncer.plan()[0].bucket_bytes == 2**21
    syncer.close()
    return {"metrics": metrics, "gap": gap, "replanned": replanned}


class RelayRank(RankWorker):
    """A trainer rank on a Ray node of its own: a role from `model_dir`, one colocated tensor sync."""

    def sync_once(
        self, model_dir: Path, role_layout: ParallelLayout, targets: list[EngineTarget], rank_sites: tuple[str, ...]
    ) -> dict[str, object]:
        """Sync into `targets`; returns this process's pid and node, whether it relayed, and each engine's gap."""
        import ray

        _, groups, model, _, engine = _trainer(model_dir, role_layout, SGD)
        cfg = SyncConfig(transport="tensor", bucket_bytes=2**20)
        syncer = build_syncer(model, groups, cfg, "colocated", targets, torch.float32, rank_sites=rank_sites)
        syncer.sync(weight_version="relayed")
        gaps = {t.url: log_prob_gap(engine, t.url) for t in targets}
        syncer.close()
        node = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node": node, "relay": syncer.relay is not None, "gaps": gaps}
