"""The bridge's layers as a megatron-core rank builds them (one gloo process): the local spec's norms are torch's
whatever else imports."""

from cases.spec_cases import spec_of

from megarl.megatron.bridge import BuildOptions, block_spec, transformer_config
from megarl.megatron.launch import spawn
from megarl.megatron.parallel import ParallelLayout
from megarl.models.spec import ModelSpec


def rank_norm_classes(specs: dict[str, ModelSpec]) -> dict[str, dict[str, str]]:
    """Build each model with megatron's import-dependent final norm set to its pick when apex imports."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import transformer_block

    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups

    transformer_block.LayerNormImpl = FusedLayerNorm  # its RMSNorm assert would fire if the final norm fell back
    groups = build_role_groups(ParallelLayout(world_size=1))
    out = {}
    for name, spec in specs.items():
        (chunk,) = build_model(spec, groups).chunks
        out[name] = {n: type(m).__name__ for n, m in chunk.named_modules() if n.endswith("norm") and "cross" not in n}
    return out


def test_local_impl_norms_are_torch_whatever_imports() -> None:
    dense, moe = spec_of("qwen3"), spec_of("qwen3_moe", num_experts=4, num_experts_per_tok=2)
    config = transformer_config(dense, BuildOptions(layout=ParallelLayout(world_size=1)))
    block = block_spec(dense, config, use_te=False, vp_stage=None, pp_rank=0).submodules
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    norms = [block.layer_norm, layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm]
    assert len(block.layer_specs) == 2 and {n.__name__ for n in norms} == {"TorchRMSNorm"}

    (built,) = spawn(rank_norm_classes, 1, {"dense": dense, "moe": moe})
    for classes in built.values():
        assert classes["decoder.final_layernorm"] == "TorchRMSNorm"
        assert set(classes.values()) == {"TorchRMSNorm"} and len(classes) == 1 + 2 * 4  # final; input, q, k, pre-MLP
