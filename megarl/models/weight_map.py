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

from dataclasses import replace

from megarl.models import mla
from megarl.models.param_mapping import ParamMapping, TPGroup
from megarl.models.spec import ModelSpec
from megarl.models.vision import checkpoint_name, vision_mappings


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of `divisible_by`×TP (megatron's padding rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _attention_mappings(spec: ModelSpec, i: int, te: bool) -> list[ParamMapping]:
    """Layer `i`'s input norm and attention: fused QKV (multi-latent attention: `megarl.models.mla`)."""
    if spec.mla is not None:
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

    The expert bias is the router's `expert_bias` buffer, not a parameter (see `megarl.megatron.bridge.moe_config`),
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
    if spec.vision is not None:
        mappings += vision_mappings(spec.vision)
        vision = spec.vision
        mappings = [replace(m, hf_names=tuple(checkpoint_name(n, vision) for n in m.hf_names)) for m in mappings]
    return {m.mcore_name: m for m in mappings}
