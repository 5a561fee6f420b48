"""The mcore ⇄ HF weight plan: which HF tensors make each megatron-core parameter, and how.

Every megatron parameter gets one `ParamMapping`, named globally (`decoder.layers.{hf layer}`,
`local_experts.{global expert}`) and at full size (TP=1). A mapping says: this mcore tensor =
these HF tensors, fused by `fuse`, padded to the padded vocabulary, split across the (expert)
tensor-parallel group on `tp_dim`. It is the one source of truth for loading HF weights, the
checkpoint converter and the resharder (see ../shared/MCORE_HF_NAMES.md for the layouts).

Each layer's MLP is dense or MoE as `ModelSpec.moe_layers` says. A MoE layer maps its router,
experts, shared expert(s) (`mlp.shared_experts.*`, with Qwen2-MoE's sigmoid `gate_weight`) and,
with sigmoid routing, the router's `expert_bias`: a buffer, not a parameter, which every user of
the plan reads and writes with the parameters (`megarl.megatron.weights.named_weights`).

Usage::

    plan = weight_plan(spec, padded_vocab_size=4096)
    m = plan["decoder.layers.0.self_attention.linear_qkv.weight"]
    full = m.merge([hf[n] for n in m.hf_names])        # [(NH+2NG)·D, H]
    shard = m.shard(full, rank=1, size=2)               # what TP rank 1 holds
    q, k, v = m.split(m.unshard([shard0, shard1]))     # back to HF
"""

from dataclasses import dataclass
from typing import Literal

import torch

from megarl.models.spec import ModelSpec

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


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of `divisible_by`×TP (megatron's padding rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _attention_mappings(spec: ModelSpec, i: int, te: bool) -> list[ParamMapping]:
    """Layer `i`'s input norm and attention: fused QKV (multi-latent attention: `megarl.models.mla`)."""
    if spec.mla is not None:
        from megarl.models import mla  # mla builds on ParamMapping from this module

        return mla.attention_mappings(spec, i, te)
    hf = f"model.layers.{i}."
    mc = f"decoder.layers.{i}."
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    groups = (spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, d)
    qkv = tuple(f"{hf}self_attn.{p}_proj" for p in "qkv")
    input_norm = f"{mc}self_attention.linear_qkv.layer_norm_weight" if te else f"{mc}input_layernorm.weight"
    out = [
        ParamMapping(input_norm, (f"{hf}input_layernorm.weight",), hf_shapes=((h,),)),
        ParamMapping(
            f"{mc}self_attention.linear_qkv.weight",
            tuple(f"{n}.weight" for n in qkv),
            fuse="qkv",
            tp_dim=0,
            tp_group="tp",
            qkv_groups=groups,
            hf_shapes=((q_rows, h), (kv_rows, h), (kv_rows, h)),
        ),
        ParamMapping(
            f"{mc}self_attention.linear_proj.weight",
            (f"{hf}self_attn.o_proj.weight",),
            tp_dim=1,
            tp_group="tp",
            hf_shapes=((h, q_rows),),
        ),
    ]
    if spec.qkv_bias:
        out.append(
            ParamMapping(
                f"{mc}self_attention.linear_qkv.bias",
                tuple(f"{n}.bias" for n in qkv),
                fuse="qkv",
                tp_dim=0,
                tp_group="tp",
                qkv_groups=groups,
                hf_shapes=((q_rows,), (kv_rows,), (kv_rows,)),
            )
        )
    if spec.qk_norm:
        for p in "qk":
            out.append(
                ParamMapping(
                    f"{mc}self_attention.{p}_layernorm.weight", (f"{hf}self_attn.{p}_norm.weight",), hf_shapes=((d,),)
                )
            )
    return out


def _glu_mlp(mc: str, hf: tuple[str, ...], width: int, h: int, tp_group: TPGroup) -> list[ParamMapping]:
    """A SwiGLU MLP `mc` (`linear_fc1`, `linear_fc2`) from the HF (gate, up, down) weights, `width` wide."""
    gate, up, down = hf
    return [
        ParamMapping(
            f"{mc}linear_fc1.weight",
            (gate, up),
            fuse="gate_up",
            tp_dim=0,
            tp_group=tp_group,
            hf_shapes=((width, h), (width, h)),
        ),
        ParamMapping(f"{mc}linear_fc2.weight", (down,), tp_dim=1, tp_group=tp_group, hf_shapes=((h, width),)),
    ]


def _dense_mlp_mappings(spec: ModelSpec, i: int, te: bool) -> list[ParamMapping]:
    hf, mc, h = f"model.layers.{i}.", f"decoder.layers.{i}.", spec.hidden_size
    pre_mlp = f"{mc}mlp.linear_fc1.layer_norm_weight" if te else f"{mc}pre_mlp_layernorm.weight"
    projections = tuple(f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
    return [
        ParamMapping(pre_mlp, (f"{hf}post_attention_layernorm.weight",), hf_shapes=((h,),)),
        *_glu_mlp(f"{mc}mlp.", projections, spec.ffn_hidden_size, h, "tp"),
    ]


def _moe_mappings(spec: ModelSpec, i: int) -> list[ParamMapping]:
    """Layer `i`'s routed experts, with the router's expert bias and the shared expert(s) where the model has them.

    The expert bias is the router's `expert_bias` buffer, not a parameter (see `megarl.models.bridge.moe_config`),
    kept in fp32 by HF (`modeling_deepseek_v3.py`, `modeling_glm4_moe.py`: `_keep_in_fp32_modules_strict =
    ["e_score_correction_bias"]`) and by SGLang (`srt/models/deepseek_v2.py::MoEGate.__init__`,
    `srt/models/glm4_moe.py::Glm4MoeGate.__init__` allocate it in fp32).
    """
    hf, mc, h, num_experts = f"model.layers.{i}.", f"decoder.layers.{i}.", spec.hidden_size, spec.num_experts
    moe = f"{hf}{spec.moe_prefix}."
    out = [
        ParamMapping(f"{mc}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",), hf_shapes=((h,),)),
        ParamMapping(f"{mc}mlp.router.weight", (f"{moe}gate.weight",), hf_shapes=((num_experts, h),)),
    ]
    if spec.moe_expert_bias:
        bias = f"{moe}gate.e_score_correction_bias"
        out.append(ParamMapping(f"{mc}mlp.router.expert_bias", (bias,), hf_shapes=((num_experts,),), keep_fp32=True))
    if spec.shared_expert_ffn_hidden_size:
        shared = f"{moe}{spec.shared_expert_prefix}."
        projections = tuple(f"{shared}{p}_proj.weight" for p in ("gate", "up", "down"))
        out += _glu_mlp(f"{mc}mlp.shared_experts.", projections, spec.shared_expert_ffn_hidden_size, h, "tp")
    if spec.shared_expert_gate:
        gate = f"{moe}shared_expert_gate.weight"
        out.append(ParamMapping(f"{mc}mlp.shared_experts.gate_weight", (gate,), hf_shapes=((1, h),)))
    for e in range(num_experts):
        names = tuple(f"{moe}experts.{e}.{n}" for n in spec.expert_weight_names)
        out += _glu_mlp(f"{mc}mlp.experts.local_experts.{e}.", names, spec.moe_ffn_hidden_size, h, "etp")
    return out


def _layer_mappings(spec: ModelSpec, i: int, te: bool) -> list[ParamMapping]:
    mlp = _moe_mappings(spec, i) if spec.is_moe and spec.moe_layers[i] else _dense_mlp_mappings(spec, i, te)
    return _attention_mappings(spec, i, te) + mlp


def weight_plan(spec: ModelSpec, padded_vocab_size: int, te: bool = False) -> dict[str, ParamMapping]:
    """Every mcore parameter of the full model (global names) → its mapping. `te`: TransformerEngine names."""
    vocab_rows = (spec.vocab_size, padded_vocab_size)
    vocab_shape = ((spec.vocab_size, spec.hidden_size),)
    mappings = [
        ParamMapping(
            "embedding.word_embeddings.weight",
            ("model.embed_tokens.weight",),
            tp_dim=0,
            tp_group="tp",
            vocab_rows=vocab_rows,
            hf_shapes=vocab_shape,
        ),
        ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), hf_shapes=((spec.hidden_size,),)),
    ]
    if not spec.tie_word_embeddings:
        mappings.append(
            ParamMapping(
                "output_layer.weight",
                ("lm_head.weight",),
                tp_dim=0,
                tp_group="tp",
                vocab_rows=vocab_rows,
                hf_shapes=vocab_shape,
            )
        )
    for i in range(spec.num_layers):
        mappings += _layer_mappings(spec, i, te)
    return {m.mcore_name: m for m in mappings}
