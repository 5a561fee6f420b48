"""Multi-latent attention (DeepSeek-V2/V3, Moonlight) in the Megatron bridge: config, layer spec, weights.

HF (transformers `modeling_deepseek_v3.py`, `DeepseekV3Attention`) ↔ megatron-core (`MLASelfAttention`,
transformer/multi_latent_attention.py), per layer under `self_attn.` / `self_attention.`:

| HF | mcore | rows × cols |
|---|---|---|
| `q_a_proj` | `linear_q_down_proj` | q_lora × H |
| `q_a_layernorm` | `q_layernorm` (TE: `linear_q_up_proj.layer_norm_weight`) | q_lora |
| `q_b_proj` (no q_lora: `q_proj`) | `linear_q_up_proj` (`linear_q_proj`) | NH·(nope+rope) × q_lora (H) |
| `kv_a_proj_with_mqa` | `linear_kv_down_proj` | (kv_lora + rope) × H: latent rows, then the shared rope key |
| `kv_a_layernorm` | `kv_layernorm` (TE: `linear_kv_up_proj.layer_norm_weight`) | kv_lora |
| `kv_b_proj` | `linear_kv_up_proj` | NH·(nope+v) × kv_lora |
| `o_proj` | `linear_proj` | H × NH·v |

Both sides lay each head out as [nope; rope] (q) and [nope; v] (kv), so no tensor is reordered. RoPE:
megatron's MLA path de-interleaves the rope dims before rotating (`_apply_rotary_pos_emb_bshd`,
`multi_latent_attention=True`), which is what HF's `apply_rotary_pos_emb_interleave` computes, so
`rope_interleave=True` (as DeepSeek and Moonlight ship) needs no weight permutation; HF's non-interleaved
variant has no megatron counterpart and is refused. YaRN scales cos/sin by the concentration factor and
the softmax by mscale(factor, mscale_all_dim)² on both sides (`YarnRotaryEmbedding`, `yarn_apply_mscale`).

The q/kv latent norms run at HF's fixed eps (`HF_LATENT_NORM_EPS`), not at `rms_norm_eps` as megatron builds
them (`MLASelfAttention.__init__` and TE's fused norm both take `config.layernorm_epsilon`): locally through
`LatentRMSNorm`, under TransformerEngine through up projections built from a config at that eps (`at_latent_eps`).
At Moonlight's rms_norm_eps (1e-5) the two eps moved tiny_deepseek_v3's log-probs by up to 5e-5 (mean 9e-6);
DeepSeek-V3 ships 1e-6.

TP: the up projections split on rows (heads), `linear_proj` on columns. The down projections are
replicated, as TransformerEngine's spec builds them (`TELinear(parallel_mode="duplicated")`). megatron's
local spec makes them `ColumnParallelLinear`s whose output `get_query_key_value_tensors` gathers over the
global TP group, which a role on its own process groups does not set; the local layer here uses megatron's
replicated `Linear` (post_training/modelopt/layers.py) instead, which MLA also accepts.
"""

import copy
import importlib.util
from dataclasses import replace
from typing import Any

import torch
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megarl.models.packed_attention import PackedDotProductAttention
from megarl.models.param_mapping import ParamMapping
from megarl.models.spec import Mla, ModelSpec

HF_LATENT_NORM_EPS = 1e-6
"""HF builds `q_a_layernorm`/`kv_a_layernorm` with `DeepseekV3RMSNorm`'s default eps, not `rms_norm_eps`."""

TE_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
"""Local MLA norm prefix → the name of TE's fused norm (`get_gpt_layer_with_transformer_engine_spec`)."""
DIST_NORM_KEYS = {
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    **{f"{local}weight": f"{te}weight" for local, te in TE_NORM_KEYS.items()},
}
"""Dist-checkpoint keys of an MLA layer's norms (`megarl.convert.dist_layout`): TE keeps the input norm a
module of its own (a TENorm), so unlike fused-QKV layers `input_layernorm.weight` keeps its name."""


class LatentRMSNorm(torch.nn.RMSNorm):
    """The q/kv latent norms at HF's fixed eps; marked `sequence_parallel` like megarl's other local norms
    (the latents are sequence-sharded again before the norm under sequence parallelism)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, **_: Any) -> None:
        super().__init__(hidden_size, eps=HF_LATENT_NORM_EPS)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def latent_norm_config(config: TransformerConfig) -> TransformerConfig:
    """A shallow copy of `config` at HF's latent-norm eps (everything else shared)."""
    latent = copy.copy(config)
    latent.layernorm_epsilon = HF_LATENT_NORM_EPS
    return latent


def at_latent_eps(norm_linear: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`norm_linear` (TE's fused norm + column-parallel linear: the q/kv up projections, whose norms are the latent
    norms) built at HF's latent-norm eps. megatron-core 0.16.1 sizes that norm's eps from the config it is given
    (extensions/transformer_engine.py::TELayerNormColumnParallelLinear.__init__: `eps=config.layernorm_epsilon`,
    the model's rms_norm_eps); the subclass gives it `latent_norm_config(config)`."""

    def __init__(self: Any, *args: Any, config: TransformerConfig, **kwargs: Any) -> None:
        norm_linear.__init__(self, *args, config=latent_norm_config(config), **kwargs)

    return type(f"Latent{norm_linear.__name__}", (norm_linear,), {"__init__": __init__})


class LatentDotProductAttention(PackedDotProductAttention):
    """megatron's local core attention (and packed sequences), accepting MLA's unequal head widths.

    megatron-core 0.16.1's `MultiLatentAttention.__init__` passes `k_channels`/`v_channels`, which only TE's
    attention takes. The local one computes with q, k and v's own widths and only sizes its output by
    `kv_channels` (`DotProductAttention.forward`: `hidden_size_per_partition`), so that is resized to v's.
    (`Attention.__init__` first builds one without the widths, which MLA then replaces.)
    """

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class RoleMLASelfAttention(MLASelfAttention):
    """`MLASelfAttention` whose full Q projection (no q_lora) is split over the role's TP group.

    megatron-core 0.16.1 builds `linear_q_proj` without `tp_group` (`MLASelfAttention.__init__`), so it
    falls back to the global TP group, which a role on its own process groups does not set, and comes out
    unsplit; it is rebuilt here like the other column-parallel projections, on `pg_collection.tp`.
    """

    def __init__(self, config: Any, submodules: MLASelfAttentionSubmodules, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        if config.q_lora_rank is None:
            self.linear_q_proj = build_module(
                submodules.linear_q_proj,
                config.hidden_size,
                config.num_attention_heads * self.q_head_dim,
                config=config,
                init_method=config.init_method,
                gather_output=False,
                bias=False,
                skip_bias_add=False,
                is_expert=False,
                tp_comm_buffer_name="q_proj",
                tp_group=self.pg_collection.tp,
            )


def check_mla(spec: ModelSpec) -> None:
    """Refuse what megatron's MLA cannot compute like HF."""
    if not spec.rope_interleave:
        raise ValueError(
            f"{spec.model_type} with rope_interleave=False is not supported: megatron's MLA always rotates "
            "interleaved rope dims; use the checkpoint's config as shipped (rope_interleave=true)"
        )


def config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """`MLATransformerConfig` fields of `spec` (megatron's `qk_head_dim` is the no-RoPE part only)."""
    assert spec.mla is not None
    check_mla(spec)
    mla = spec.mla
    kwargs: dict[str, Any] = {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rotary_base": spec.rope_theta,
        "rope_type": "rope",
    }
    if spec.yarn is not None:
        yarn = spec.yarn
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
    return kwargs


def _without_te_placeholders() -> None:
    """Without transformer_engine, megatron's extensions module hands out MagicMock placeholders, and
    `isinstance(self.linear_proj, TELinear)` in `MultiLatentAttention.__init__` raises TypeError; its guard
    `HAVE_TE` (the only use) is then made to say what is true."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _with_attention(layer: ModuleSpec, **changes: Any) -> ModuleSpec:
    """`layer` with its attention module `RoleMLASelfAttention` and `changes` to the attention's submodules."""
    attention = layer.submodules.self_attention
    attention = replace(attention, module=RoleMLASelfAttention, submodules=replace(attention.submodules, **changes))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))


def layer_spec(num_experts: int | None, use_te: bool) -> ModuleSpec:
    """An MLA decoder layer; dense when `num_experts` is None. Local layers save their norms under TE's names."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        te = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, multi_latent_attention=True
        )
        up = te.submodules.self_attention.submodules
        return _with_attention(
            te,
            linear_q_up_proj=at_latent_eps(up.linear_q_up_proj),
            linear_kv_up_proj=at_latent_eps(up.linear_kv_up_proj),
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _without_te_placeholders()
    local = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        multi_latent_attention=True,
        normalization="RMSNorm",
    )
    local = _with_attention(
        local,
        linear_q_down_proj=Linear,
        linear_kv_down_proj=Linear,
        core_attention=LatentDotProductAttention,
        q_layernorm=LatentRMSNorm,
        kv_layernorm=LatentRMSNorm,
    )
    keys_map = dict(TE_NORM_KEYS)
    if num_experts is None:  # TE fuses a dense layer's pre-MLP norm into fc1; a MoE layer keeps a TENorm
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return replace(local, submodules=replace(local.submodules, sharded_state_dict_keys_map=keys_map))


def _linear(mcore: str, hf: str, shape: tuple[int, int], tp_dim: int | None) -> ParamMapping:
    return ParamMapping(
        mcore, (hf,), tp_dim=tp_dim, tp_group="tp" if tp_dim is not None else "none", hf_shapes=(shape,)
    )


def _q_mappings(mla: Mla, num_heads: int, h: int, mc: str, hf: str, te: bool) -> list[ParamMapping]:
    q_rows = num_heads * mla.qk_head_dim
    if mla.q_lora_rank is None:
        return [_linear(f"{mc}linear_q_proj.weight", f"{hf}q_proj.weight", (q_rows, h), 0)]
    rank = mla.q_lora_rank
    norm = f"{mc}linear_q_up_proj.layer_norm_weight" if te else f"{mc}q_layernorm.weight"
    return [
        _linear(f"{mc}linear_q_down_proj.weight", f"{hf}q_a_proj.weight", (rank, h), None),
        ParamMapping(norm, (f"{hf}q_a_layernorm.weight",), hf_shapes=((rank,),)),
        _linear(f"{mc}linear_q_up_proj.weight", f"{hf}q_b_proj.weight", (q_rows, rank), 0),
    ]


def attention_mappings(spec: ModelSpec, i: int, te: bool) -> list[ParamMapping]:
    """Layer `i`'s input norm and attention parameters (HF layer = mcore layer; no MTP layer is named)."""
    assert spec.mla is not None
    mla, h, num_heads = spec.mla, spec.hidden_size, spec.num_heads
    hf, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    latent = mla.kv_lora_rank
    kv_norm = f"{mc}linear_kv_up_proj.layer_norm_weight" if te else f"{mc}kv_layernorm.weight"
    return [
        ParamMapping(
            f"decoder.layers.{i}.input_layernorm.weight",
            (f"model.layers.{i}.input_layernorm.weight",),
            hf_shapes=((h,),),
        ),
        *_q_mappings(mla, num_heads, h, mc, hf, te),
        _linear(
            f"{mc}linear_kv_down_proj.weight",
            f"{hf}kv_a_proj_with_mqa.weight",
            (latent + mla.qk_rope_head_dim, h),
            None,
        ),
        ParamMapping(kv_norm, (f"{hf}kv_a_layernorm.weight",), hf_shapes=((latent,),)),
        _linear(
            f"{mc}linear_kv_up_proj.weight",
            f"{hf}kv_b_proj.weight",
            (num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), latent),
            0,
        ),
        _linear(f"{mc}linear_proj.weight", f"{hf}o_proj.weight", (h, num_heads * mla.v_head_dim), 1),
    ]
