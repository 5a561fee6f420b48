"""One megatron linear layer's adapters: this rank's shards of A and B per targeted HF projection, and the term they
add to the layer's output.

Tensor parallelism (TP group of the layer; experts run with expert-TP 1 and need no communication here):

- column-parallel (`tp_dim` 0: linear_qkv, linear_fc1, MLA's up projections): A `[r, in]` replicated, B
  `[out/tp, r]` split like the output rows. a = x·Aᵀ is identical on every rank, so its backward is summed over TP
  (`copy_to_tensor_model_parallel_region`). Under sequence parallelism x is this rank's sequence shard: a is
  computed on it and all-gathered (r columns, not the hidden size), whose backward reduce-scatters; A's gradient
  then covers this shard only and is marked `sequence_parallel` for megatron's finalize_model_grads
  (distributed/finalize_model_grads.py `_allreduce_non_tensor_model_parallel_grads`) to sum over TP.
- row-parallel (`tp_dim` 1: linear_proj, linear_fc2): A `[r, in/tp]` split like the input, B `[out, r]`
  replicated. a = Σ over TP of x_local·A_localᵀ (an all-reduce, or a reduce-scatter to the sequence shard under
  sequence parallelism, B then marked `sequence_parallel`), as the layer reduces its own output
  (tensor_parallel/layers.py `RowParallelLinear.forward`).
- replicated (`tp_dim` None: MLA's down projections): both replicated; under sequence parallelism both marked.

Fused layers put each projection's output where the weight plan puts its rows: `linear_qkv` per query group
`[q; k; v]`, `linear_fc1` `[gate; up]` (`megarl.models.param_mapping.ParamMapping.merge`); an untargeted
projection of a fused layer adds zeros.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)

from megarl.lora.targets import LoraPart, LoraTarget


@dataclass(frozen=True, slots=True)
class Sharding:
    """How this rank holds a target: its TP rank and size (1 for experts), whether activations are sequence-sharded
    around it, and which data-parallel copy it holds."""

    tp_size: int
    tp_rank: int
    group: torch.distributed.ProcessGroup | None
    sequence_parallel: bool
    dp_rank: int = 0
    """Its rank among the copies of the target's shard: over DP×CP, or expert-DP for experts (checkpoints save
    DP rank 0's)."""


def kaiming_a(part: LoraPart, rank: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's default A (peft/tuners/lora/layer.py `LoraLayer.reset_lora_parameters`: kaiming_uniform_ with
    a=√5): U(-1/√in, 1/√in)."""
    bound = 1.0 / math.sqrt(part.in_features)
    return torch.empty(rank, part.in_features).uniform_(-bound, bound, generator=generator)


def gaussian_a(part: LoraPart, rank: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's `init_lora_weights="gaussian"`: N(0, (1/r)²)."""
    return torch.empty(rank, part.in_features).normal_(0.0, 1.0 / rank, generator=generator)


InitA = Callable[[LoraPart], torch.Tensor]
"""A part's full-size A (float32, CPU), the same on every rank that holds a shard of it."""


class LoraAdapter(torch.nn.Module):
    """The adapters of one layer (`target`) on this rank: `a[i]`, `b[i]` for `target.parts[i]`."""

    def __init__(
        self,
        target: LoraTarget,
        rank: int,
        scale: float,
        dropout: float,
        sharding: Sharding,
        init_a: InitA,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.target, self.rank, self.scale, self.dropout, self.sharding = target, rank, scale, dropout, sharding
        self.enabled = True
        a_shards = [self.shard(init_a(part), 1) for part in target.parts]
        b_shards = [self.shard(torch.zeros(part.out_features, rank), 0) for part in target.parts]
        self.a = torch.nn.ParameterList([torch.nn.Parameter(t.to(device=device, dtype=dtype)) for t in a_shards])
        self.b = torch.nn.ParameterList([torch.nn.Parameter(t.to(device=device, dtype=dtype)) for t in b_shards])
        self._mark_parameters()

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """The slice this rank holds of a full-size factor (`dim` 1: A, 0: B): split where the layer splits it (A of
        a row layer, B of a column one), else the whole."""
        size, rank = self.sharding.tp_size, self.sharding.tp_rank
        split = self.target.tp_dim == dim and size > 1
        return full.chunk(size, dim=dim)[rank].contiguous() if split else full

    def _mark_parameters(self) -> None:
        """megatron's attributes: `tensor_model_parallel` on the TP-split factor (the gradient norm counts every
        rank's shard, and a replicated factor on TP rank 0 only: tensor_parallel/layers.py
        `param_is_not_tensor_parallel_duplicate`), `sequence_parallel` on the factors whose gradient covers this
        rank's sequence shard only, `allreduce` False on experts' (DDP then reduces them over expert-data-parallel
        ranks, as the experts)."""
        if self.sharding.tp_size > 1 and self.target.tp_dim is not None:
            for param in self.b if self.target.tp_dim == 0 else self.a:
                set_tensor_model_parallel_attributes(param, True, self.target.tp_dim, 1)
        a, b = list(self.a), list(self.b)
        if self.sharding.sequence_parallel:
            marked = {0: a, 1: b, None: a + b}[self.target.tp_dim]
            for param in marked:
                param.sequence_parallel = True
        if self.target.expert:
            for param in a + b:
                param.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The term added to the layer's output for its input `x` (`[s(/tp), b, in(/tp)]`)."""
        x = torch.nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x
        low = self._low_rank(torch.nn.functional.linear(x, torch.cat(list(self.a))))  # [s', b, parts·r]
        outs = [torch.nn.functional.linear(a, b) for a, b in zip(low.split(self.rank, dim=-1), self.b, strict=True)]
        return self._fuse(outs) * self.scale

    def _low_rank(self, a: torch.Tensor) -> torch.Tensor:
        """x·Aᵀ made whole for B: summed over TP (row), gathered or marked for the backward sum (column)."""
        s, group, tp_dim = self.sharding, self.sharding.group, self.target.tp_dim
        if s.tp_size == 1 or tp_dim is None:
            return a
        if tp_dim == 1:
            return (
                reduce_scatter_to_sequence_parallel_region(a, group=group)
                if s.sequence_parallel
                else (reduce_from_tensor_model_parallel_region(a, group=group))
            )
        if s.sequence_parallel:
            return gather_from_sequence_parallel_region(a, tensor_parallel_output_grad=True, group=group)
        return copy_to_tensor_model_parallel_region(a, group=group)

    def _fuse(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Per-part outputs (last dim) → the layer's local output layout, zeros for untargeted parts."""
        mapping, size = self.target.mapping, self.sharding.tp_size
        if mapping.fuse == "none":
            return outs[0]
        parts = iter(outs)
        local = [shape[0] // size for shape in mapping.hf_shapes]
        full = [
            next(parts) if on else outs[0].new_zeros(*outs[0].shape[:-1], rows)
            for on, rows in zip(self.target.present, local, strict=True)
        ]
        if mapping.fuse == "gate_up":
            return torch.cat(full, dim=-1)
        assert mapping.qkv_groups is not None
        groups = mapping.qkv_groups[0] // size
        grouped = [t.reshape(*t.shape[:-1], groups, -1) for t in full]
        return torch.cat(grouped, dim=-1).flatten(-2)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scale·B·A as this rank's shard of the layer's weight (the mcore layout, fused): what `merged` adds."""
        deltas = [(b.float() @ a.float()).t() for a, b in zip(self.a, self.b, strict=True)]  # [in(/tp), out(/tp)]
        return (self._fuse(deltas) * self.scale).t().contiguous()
