"""The planner: which trainer rank sends which HF tensor, and in which bucket.

Every megatron parameter has one *owner*, the rank that gathers its shards and sends the HF
tensors it becomes: for dense parameters the rank with TP, CP and DP rank 0 in its pipeline
stage; for experts the rank with expert-TP and expert-DP rank 0 in its EP group, so each EP rank
sends its own experts. The other ranks of the owner's (expert-)TP group are its *peers*: they
send their shard to the owner. Each owner packs its tensors, in model order, into buckets of at
most `bucket_bytes` (a larger tensor gets a bucket of its own); the global schedule takes one
bucket from each owner in turn, so pipeline stages and EP ranks all make progress.

Tensors travel in the engine's dtype, except those HF keeps in fp32 (`ParamMapping.keep_fp32`, e.g. the
routers' expert bias): they travel in fp32, and every bucket holds one dtype (a broadcast names one dtype
per bucket, and SGLang rejects tensors at offsets unaligned to their dtype, `srt/weight_sync/tensor_bucket.py`).

`plan_sync` is collective over the role's ranks; `LocalParams` is what this rank holds.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.lora.model import adapter_of
from megarl.megatron.model import BuiltModel
from megarl.megatron.parallel import RoleGroups
from megarl.megatron.weights import local_mapping, model_plan, named_weights
from megarl.models.param_mapping import ParamMapping


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One megatron parameter, sent as the HF tensors it maps to."""

    mcore_name: str
    owner: int
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    """Bytes of its HF tensors in `dtype`."""
    dtype: torch.dtype
    """What it travels in: the engine's dtype, or fp32 where HF keeps the tensor in fp32."""


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    """Position in the sync's global schedule."""
    owner: int
    tensors: tuple[PlannedTensor, ...]
    nbytes: int
    dtype: torch.dtype
    """Every tensor's (`PlannedTensor.dtype`)."""

    def typed(self, buffer: torch.Tensor) -> torch.Tensor:
        """The first `nbytes` of a 1-D `buffer` (of any dtype, e.g. an `allocate`d uint8 one) in the bucket's dtype."""
        return buffer.view(torch.uint8)[: self.nbytes].view(self.dtype)

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Each HF tensor of the bucket as a view of `flat`, packed back to back in order."""
        named, offset = [], 0
        for tensor in self.tensors:
            for name, shape in zip(tensor.hf_names, tensor.hf_shapes, strict=True):
                size = math.prod(shape)
                named.append((name, flat[offset : offset + size].view(shape)))
                offset += size
        return named

    def tensor_slots(self, flat: torch.Tensor) -> list[list[torch.Tensor]]:
        """`views(flat)` without names, grouped by tensor: each tensor's HF slots."""
        views = iter(self.views(flat))
        return [[next(views)[1] for _ in tensor.hf_names] for tensor in self.tensors]

    def describe(self) -> str:
        names = [n for t in self.tensors for n in t.hf_names]
        span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return (
            f"bucket {self.index} from rank {self.owner} ({len(names)} tensors, {self.nbytes / 2**20:.1f} MiB: {span})"
        )


@dataclass(frozen=True, slots=True)
class SyncPlan:
    tensors: tuple[PlannedTensor, ...]
    """Every parameter once, owners in rank order, each owner's in model order."""
    bucket_bytes: int

    @property
    def owners(self) -> list[int]:
        return sorted({t.owner for t in self.tensors})

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def largest_tensor_bytes(self) -> int:
        return max(t.nbytes for t in self.tensors)

    def buckets(self, include: set[str] | None = None) -> list[Bucket]:
        """The schedule: each owner's tensors (those in `include`, default all) packed greedily, one dtype per
        bucket, owners interleaved round-robin."""
        per_owner: dict[int, list[list[PlannedTensor]]] = {}
        open_: dict[tuple[int, torch.dtype], tuple[list[PlannedTensor], int]] = {}  # each (owner, dtype)'s last
        for tensor in self.tensors:
            if include is not None and tensor.mcore_name not in include:
                continue
            key = (tensor.owner, tensor.dtype)
            packed, filled = open_.get(key, (None, 0))
            if packed is None or filled + tensor.nbytes > self.bucket_bytes:
                packed, filled = [], 0
                per_owner.setdefault(tensor.owner, []).append(packed)
            packed.append(tensor)
            open_[key] = (packed, filled + tensor.nbytes)
        out: list[Bucket] = []
        for round_ in range(max((len(b) for b in per_owner.values()), default=0)):
            for owner in sorted(per_owner):
                if round_ < len(per_owner[owner]):
                    group = tuple(per_owner[owner][round_])
                    out.append(Bucket(len(out), owner, group, sum(t.nbytes for t in group), group[0].dtype))
        return out


@dataclass(frozen=True, slots=True)
class LocalParam:
    """A parameter this rank takes part in sending: as its owner or as a peer of the owner."""

    param: torch.Tensor
    mapping: ParamMapping
    group: dist.ProcessGroup
    """The (expert-)TP group its shards are gathered over."""
    group_size: int
    owner_in_group: int
    """The owner's global rank (gather destination)."""
    delta: Callable[[], torch.Tensor] | None = None
    """LoRA `merged` sync: this rank's shard of scale·B·A, added to `param` as it is sent (None: `param` as is)."""

    def weight(self) -> torch.Tensor:
        """What is sent of this parameter: the parameter, or with LoRA merged W + scale·B·A (made now, one bucket's
        tensors at a time, never the whole model)."""
        if self.delta is None:
            return self.param.detach()
        return (self.param.detach().float() + self.delta()).to(self.param.dtype)


LocalParams = dict[str, LocalParam]
"""Global mcore name → what this rank holds of it."""


def _is_owner(groups: RoleGroups, expert: bool) -> bool:
    if expert:
        return groups.etp_rank == 0 and groups.pgs.expt_dp.rank() == 0
    return groups.tp_rank == 0 and groups.pgs.cp.rank() == 0 and groups.dp_rank == 0


def _hf_bytes(mapping: ParamMapping, dtype: torch.dtype) -> int:
    return sum(math.prod(shape) for shape in mapping.hf_shapes) * torch.empty((), dtype=dtype).element_size()


def plan_sync(
    model: BuiltModel, groups: RoleGroups, engine_dtype: torch.dtype, bucket_bytes: int, merge_lora: bool = False
) -> tuple[SyncPlan, LocalParams]:
    """The global plan and this rank's part in it. Collective over the default process group. `merge_lora`: the
    weights of layers with LoRA adapters are sent merged (`LocalParam.delta`)."""
    if model.value_head:
        raise ValueError("weight sync sends a policy to the engines; this model has a value head (a critic)")
    plan = model_plan(model, groups)
    rank = dist.get_rank()
    owned: list[PlannedTensor] = []
    candidates: dict[str, tuple[torch.Tensor, ParamMapping, dist.ProcessGroup, int, Any]] = {}
    for chunk in model.chunks:
        for name, param in named_weights(chunk):
            mapping, _, size = local_mapping(name, chunk, groups, plan, model.spec)
            if name == "output_layer.weight" and mapping.mcore_name != "output_layer.weight":
                continue  # the last stage's copy of tied embeddings: the first stage sends them
            expert = mapping.tp_group == "etp"
            group = groups.pgs.expt_tp if expert else groups.pgs.tp
            adapter = adapter_of(chunk, name) if merge_lora else None
            candidates[mapping.mcore_name] = (param, mapping, group, size, adapter and adapter.delta_weight)
            if _is_owner(groups, expert):
                dtype = torch.float32 if mapping.keep_fp32 else engine_dtype
                nbytes = _hf_bytes(mapping, dtype)
                owned.append(
                    PlannedTensor(mapping.mcore_name, rank, mapping.hf_names, mapping.hf_shapes, nbytes, dtype)
                )
    everyone: list[list[PlannedTensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, owned)
    tensors = tuple(t for part in everyone for t in part or [])
    local: LocalParams = {}
    for tensor in tensors:
        if tensor.mcore_name not in candidates:
            continue
        param, mapping, group, size, delta = candidates[tensor.mcore_name]
        if tensor.owner in dist.get_process_group_ranks(group):
            local[tensor.mcore_name] = LocalParam(param, mapping, group, size, tensor.owner, delta)
    return SyncPlan(tensors, bucket_bytes), local
