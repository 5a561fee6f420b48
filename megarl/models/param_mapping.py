"""`ParamMapping`: how one megatron-core parameter is made of HF tensors (fused, padded, split across
tensor parallelism) and back. `megarl.models.weight_map` and `megarl.models.mla` build the plans from it."""

from dataclasses import dataclass
from typing import Literal

import torch

Fuse = Literal["none", "qkv", "gate_up"]
TPGroup = Literal["tp", "etp", "none"]


@dataclass(frozen=True, slots=True)
class ParamMapping:
    mcore_name: str
    hf_names: tuple[str, ...]
    fuse: Fuse = "none"
    tp_dim: int | None = None
    """Dimension split across the tensor-parallel group; None = replicated."""
    tp_group: TPGroup = "none"
    """`tp` for dense layers, `etp` (expert tensor parallel) inside experts."""
    vocab_rows: tuple[int, int] | None = None
    """(true vocab, padded vocab) for embedding and output layer: rows past the true vocab are zero."""
    qkv_groups: tuple[int, int, int] | None = None
    """(query groups, query heads per group, head dim) for the fused QKV layout."""
    hf_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of each HF tensor in `hf_names` that the model's config implies."""
    keep_fp32: bool = False
    """HF keeps these tensors in fp32 whatever the model's dtype (its `_keep_in_fp32_modules_strict`), and so do
    the engines: the weight sync sends them in fp32."""

    def merge(self, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
        """HF tensors → the full mcore tensor."""
        if len(hf_tensors) != len(self.hf_names):
            raise ValueError(f"{self.mcore_name} needs {len(self.hf_names)} HF tensors, got {len(hf_tensors)}")
        for name, shape, tensor in zip(self.hf_names, self.hf_shapes, hf_tensors, strict=True):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: the checkpoint has shape {tuple(tensor.shape)}, the config implies {shape}")
        if self.fuse == "qkv":
            assert self.qkv_groups is not None
            num_groups, heads_per_group, head_dim = self.qkv_groups
            q, k, v = hf_tensors
            tail = q.shape[1:]
            parts = [
                q.reshape(num_groups, heads_per_group * head_dim, *tail),
                k.reshape(num_groups, head_dim, *tail),
                v.reshape(num_groups, head_dim, *tail),
            ]
            return torch.cat(parts, dim=1).reshape(-1, *tail)
        if self.fuse == "gate_up":
            return torch.cat(hf_tensors, dim=0)
        (full,) = hf_tensors
        if self.vocab_rows is not None:
            vocab, padded = self.vocab_rows
            full = torch.cat([full, full.new_zeros(padded - vocab, *full.shape[1:])]) if padded > vocab else full
        return full

    def split(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The full mcore tensor → HF tensors (inverse of `merge`)."""
        if self.fuse == "qkv":
            assert self.qkv_groups is not None
            num_groups, heads_per_group, head_dim = self.qkv_groups
            tail = full.shape[1:]
            grouped = full.reshape(num_groups, (heads_per_group + 2) * head_dim, *tail)
            q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
            return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
        if self.fuse == "gate_up":
            return list(full.chunk(2, dim=0))
        if self.vocab_rows is not None:
            return [full[: self.vocab_rows[0]]]
        return [full]

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """The slice of the full tensor that (expert-)TP rank `rank` of `size` holds."""
        if self.tp_dim is None or size == 1:
            return full
        if self.fuse == "gate_up":
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
        return full.chunk(size, dim=self.tp_dim)[rank]

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate the TP shards (rank order) back into the full tensor."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        if self.fuse == "gate_up":
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards, dim=self.tp_dim)
