"""HF model spec → megatron-core `TransformerConfig`, layer and block specs and `GPTModel` arguments."""

import dataclasses
import importlib.util
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megarl.megatron.parallel import ParallelLayout
from megarl.models import mla
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import padded_vocab_size


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """How the Megatron model is built, independent of the architecture."""

    layout: ParallelLayout
    params_dtype: torch.dtype = torch.float32
    use_te: bool = False
    """TransformerEngine layer spec; only when transformer_engine imports (GPU)."""
    moe_token_dispatcher: str = "alltoall"


FUSED_SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
"""apex's kernels behind megatron's causal fused softmax (fusions/fused_softmax.py): `is_kernel_available`
calls `scaled_masked_softmax_cuda.get_batch_per_block`, the causal forward `scaled_upper_triang_masked_softmax_cuda`."""


def softmax_fusion_available(on_gpu: bool) -> bool:
    """Whether megatron's fused masked softmax can run: on GPU, and only when apex's kernels import.

    `FusedScaleMaskSoftmax` imports them for bf16/fp16 sequences longer than 16; without them the
    first such forward fails. Else torch's softmax runs.
    """
    return on_gpu and all(importlib.util.find_spec(name) is not None for name in FUSED_SOFTMAX_KERNELS)


def transformer_config(spec: ModelSpec, opts: BuildOptions) -> TransformerConfig:
    """The megatron TransformerConfig of `spec` under the layout and dtype of `opts`."""
    cpu = not torch.cuda.is_available()
    layout = opts.layout
    config_class, attention = (MLATransformerConfig, mla.config_kwargs(spec)) if spec.mla else (TransformerConfig, {})
    return config_class(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=layout.num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=layout.num_layers_in_last_stage,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=opts.params_dtype,
        pipeline_dtype=opts.params_dtype,
        bf16=opts.params_dtype == torch.bfloat16,
        fp16=opts.params_dtype == torch.float16,
        variable_seq_lengths=layout.pp > 1,
        use_cpu_initialization=cpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=softmax_fusion_available(on_gpu=not cpu),
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_token_dispatcher_type=opts.moe_token_dispatcher,
        mrope_section=list(spec.vision.mrope_section) if spec.vision else None,
        **moe_config(spec),
        **attention,
    )


def moe_layer_freq(spec: ModelSpec) -> int | list[int]:
    """megatron's `moe_layer_freq`: 1 when every layer routes, else the per-layer pattern (1 = MoE, 0 = dense).

    The pattern changes the dist-checkpoint keys: with a list, megatron saves each layer under its own
    key instead of stacking layers on a leading axis (transformer_block.py `TransformerBlock.sharded_state_dict`,
    `non_homogeneous_layers`), which `megarl.convert.dist_layout.dist_slot` follows.
    """
    if all(spec.moe_layers):
        return 1
    return [int(moe) for moe in spec.moe_layers]


def moe_config(spec: ModelSpec) -> dict[str, Any]:
    """The MoE fields of the TransformerConfig (none for a dense model).

    The expert bias (HF `e_score_correction_bias`) is selection-only and frozen: megatron nudges it
    after each step by `moe_router_bias_update_rate` (finalize_model_grads.py `_update_router_expert_bias`),
    which is 0 here, and megarl's finalize skips that update (`megarl.megatron.optim`). It is a persistent
    buffer of the router (router.py `TopKRouter.__init__`), so it is saved and loaded with the weights
    but never trained.
    """
    if not spec.is_moe:
        return {}
    return {
        "num_moe_experts": spec.num_experts,
        "moe_layer_freq": moe_layer_freq(spec),
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_topk": spec.moe_topk,
        "moe_router_pre_softmax": spec.moe_pre_softmax,
        "moe_router_score_function": spec.moe_score_function,
        "moe_router_enable_expert_bias": spec.moe_expert_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": spec.moe_num_groups or None,
        "moe_router_group_topk": spec.moe_group_topk or None,
        "moe_router_topk_scaling_factor": spec.moe_scaling_factor,
        "moe_shared_expert_intermediate_size": spec.shared_expert_ffn_hidden_size or None,
        "moe_shared_expert_gate": spec.shared_expert_gate,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if spec.moe_aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": spec.moe_aux_loss_coeff,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
    }


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron's specs build norms, for local layers with or without sequence parallelism.

    megatron's `WrappedTorchNorm` refuses `sequence_parallel` (transformer/torch_norm.py), so local layers
    could not run MoE with TP>1 (which needs it) on a GPU. The norm is position-wise; under sequence
    parallelism only its weight's gradient needs the TP all-reduce, which `finalize_model_grads` gives
    parameters marked `sequence_parallel`.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _with_torch_norms(spec: Any) -> Any:
    """`spec` with megarl's local modules, recursively: each `WrappedTorchNorm` → `TorchRMSNorm`, and megatron's
    `DotProductAttention` → `PackedDotProductAttention` (the same, also over packed sequences)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megarl.models.packed_attention import PackedDotProductAttention

    if spec is WrappedTorchNorm:
        return TorchRMSNorm
    if spec is DotProductAttention:
        return PackedDotProductAttention
    if isinstance(spec, ModuleSpec):
        return replace(spec, module=_with_torch_norms(spec.module), submodules=_with_torch_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _with_torch_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return replace(spec, **changes)
    return spec


def layer_spec(spec: ModelSpec, use_te: bool, moe: bool) -> ModuleSpec:
    """One decoder layer, its MLP routed experts (`moe`) or dense: TransformerEngine's spec when asked for,
    else megatron's local (torch) spec.

    Both store a checkpoint under the same keys. The local spec saves its norms under TE's names
    (`sharded_state_dict_keys_map` in gpt_layer_specs.py: `input_layernorm.` → `self_attention.linear_qkv.layer_norm_`,
    `pre_mlp_layernorm.` → `mlp.linear_fc1.layer_norm_`). TE's MoE layer keeps `pre_mlp_layernorm` as a module
    of its own (a TENorm, saved as `pre_mlp_layernorm.weight`), so the local MoE layer drops that second entry.
    """
    num_experts = spec.num_experts if moe else None
    if spec.mla is not None:
        mla_layer = mla.layer_spec(num_experts, use_te)
        return mla_layer if use_te else _with_torch_norms(mla_layer)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = _with_torch_norms(
        get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm, normalization="RMSNorm"
        )
    )
    if not num_experts:
        return local
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    return replace(local, submodules=replace(local.submodules, sharded_state_dict_keys_map=keys_map))


def final_norm(use_te: bool) -> type:
    """The decoder's last norm: TE's with TE layers, else torch's (`TorchRMSNorm`)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return TorchRMSNorm


def block_spec(
    spec: ModelSpec, config: TransformerConfig, use_te: bool, vp_stage: int | None, pp_rank: int
) -> ModuleSpec:
    """The decoder block of one (virtual) pipeline stage: its layers and, named here, its final norm.

    Each layer is dense or MoE as `spec.moe_layers` says for its global index (the stage's first layer
    is `get_transformer_layer_offset`, as in gpt_layer_specs.py `get_gpt_decoder_block_spec`).

    Given a layer spec alone, megatron picks the final norm by what imports (transformer_block.py
    `LayerNormImpl`): TENorm if transformer_engine does, else apex's FusedLayerNorm, which refuses
    RMSNorm, else torch's. Local layers' own norms are `TorchRMSNorm` (megatron's local spec says
    `WrappedTorchNorm`, which refuses sequence parallelism).
    """
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    is_moe = (spec.moe_layers or (False,) * spec.num_layers)[offset : offset + num_layers]
    specs = {moe: layer_spec(spec, use_te, moe) for moe in set(is_moe)}
    layers = TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in is_moe], layer_norm=final_norm(use_te))
    return ModuleSpec(module=TransformerBlock, submodules=layers)


def gpt_model_kwargs(spec: ModelSpec, opts: BuildOptions) -> dict[str, Any]:
    """Keyword arguments of `GPTModel` besides config, spec, stage flags and process groups."""
    return {
        "vocab_size": padded_vocab_size(spec.vocab_size, opts.layout.tp),
        "max_sequence_length": spec.max_position_embeddings,
        "share_embeddings_and_output_weights": spec.tie_word_embeddings,
        "position_embedding_type": "mrope" if spec.vision else "rope",
        "rotary_base": int(spec.rope_theta),
        "rotary_percent": spec.rotary_percent,
        "rope_scaling": spec.rope_scaling_factor is not None,
        "rope_scaling_factor": spec.rope_scaling_factor or 8.0,
        "parallel_output": True,
    }
