"""The bridge, mostly without processes: HF config reading, the weight plan, micro-batching, the CPU layer, norms."""

import pytest
import torch
import transformers
from cases.spec_cases import spec_of

from megarl.assets import asset_path
from megarl.megatron import cpu_compat
from megarl.megatron.bridge import BuildOptions, block_spec, softmax_fusion_available, transformer_config
from megarl.megatron.micro_batches import split_by_count, split_by_token_budget
from megarl.megatron.model import use_transformer_engine
from megarl.megatron.packing import align_left, aligned_length
from megarl.megatron.parallel import ParallelLayout
from megarl.models.spec import model_spec
from megarl.models.weight_map import padded_vocab_size, weight_plan


def test_spec_reads_each_architecture() -> None:
    assert spec_of("qwen2").qkv_bias and not spec_of("qwen2").qk_norm
    assert spec_of("qwen3", head_dim=32).head_dim == 32 and spec_of("qwen3").qk_norm
    llama = spec_of(
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert llama.rope_scaling_factor == 8.0 and not llama.qkv_bias
    moe = spec_of("qwen3_moe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    assert (moe.num_experts, moe.moe_topk, moe.moe_pre_softmax, moe.moe_prefix) == (4, 2, True, "mlp")
    mixtral = spec_of("mixtral", num_local_experts=8)
    assert mixtral.num_experts == 8 and not mixtral.moe_pre_softmax and mixtral.moe_prefix == "block_sparse_moe"


def test_spec_reads_dense_layers_shared_experts_and_sigmoid_routing() -> None:
    qwen3 = spec_of("qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    assert qwen3.moe_layers == (False, True) and qwen3.num_moe_layers == 1
    qwen2 = model_spec(transformers.AutoConfig.from_pretrained(asset_path("models/tiny_qwen2_moe")))
    assert (qwen2.shared_expert_ffn_hidden_size, qwen2.shared_expert_gate, qwen2.qkv_bias) == (64, True, True)
    assert (qwen2.moe_score_function, qwen2.moe_pre_softmax, qwen2.moe_expert_bias) == ("softmax", True, False)
    glm = model_spec(transformers.AutoConfig.from_pretrained(asset_path("models/tiny_glm4_moe")))
    assert glm.moe_layers == (False, True) and glm.shared_expert_ffn_hidden_size == 32 and not glm.shared_expert_gate
    assert (glm.moe_score_function, glm.moe_expert_bias, glm.moe_scaling_factor) == ("sigmoid", True, 2.5)
    assert (glm.rotary_percent, glm.qkv_bias, glm.qk_norm) == (0.5, True, False)


def test_mixed_layers_map_per_layer_and_the_expert_bias_stays_frozen() -> None:
    glm = model_spec(transformers.AutoConfig.from_pretrained(asset_path("models/tiny_glm4_moe")))
    plan = weight_plan(glm, 4096, te=True)
    assert plan["decoder.layers.0.mlp.linear_fc1.weight"].hf_shapes == ((128, 64), (128, 64))  # dense layer 0
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in plan  # TE's MoE layer keeps its own norm
    bias = plan["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.hf_names == ("model.layers.1.mlp.gate.e_score_correction_bias",) and bias.tp_dim is None
    shared = plan["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert shared.hf_names[0] == "model.layers.1.mlp.shared_experts.gate_proj.weight" and shared.tp_group == "tp"
    qwen2 = model_spec(transformers.AutoConfig.from_pretrained(asset_path("models/tiny_qwen2_moe")))
    gate = weight_plan(qwen2, 4096)["decoder.layers.0.mlp.shared_experts.gate_weight"]
    assert gate.hf_names == ("model.layers.0.mlp.shared_expert_gate.weight",) and gate.hf_shapes == ((1, 64),)

    config = transformer_config(glm, BuildOptions(layout=ParallelLayout(world_size=2, pp=2)))
    assert config.moe_layer_freq == [0, 1] and config.moe_router_bias_update_rate == 0.0
    assert config.moe_router_enable_expert_bias and config.moe_router_topk_scaling_factor == 2.5
    stages = [block_spec(glm, config, use_te=False, vp_stage=None, pp_rank=r).submodules for r in (0, 1)]
    assert [type(s.layer_specs[0].submodules.mlp.submodules).__name__ for s in stages] == [
        "MLPSubmodules",
        "MoESubmodules",
    ]


def test_spec_refuses_what_it_cannot_map() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        model_spec(transformers.AutoConfig.for_model("gpt2"))
    with pytest.raises(ValueError, match="attention_bias"):
        spec_of("llama", attention_bias=True)
    # megatron-core scores a group by its top (top-k // topk_group) experts, transformers by its top 2
    with pytest.raises(ValueError, match="n_group=8"):
        spec_of("deepseek_v3", num_experts_per_tok=6)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        spec_of("glm4_moe", norm_topk_prob=False)


def test_plan_covers_every_hf_tensor_once() -> None:
    spec = spec_of("qwen3_moe", num_experts=4, num_experts_per_tok=2)
    plan = weight_plan(spec, padded_vocab_size(spec.vocab_size, 2))
    hf_names = [n for m in plan.values() for n in m.hf_names]
    assert len(hf_names) == len(set(hf_names))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in hf_names
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in plan
    te = weight_plan(spec_of("qwen2"), 256, te=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te


def test_qkv_and_gate_up_round_trip_through_shards() -> None:
    spec = spec_of("qwen2")
    plan = weight_plan(spec, 256)
    qkv = plan["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    full = qkv.merge([q, k, v])
    assert full.shape == (128, 64)
    assert torch.equal(full[:32], q[:32]) and torch.equal(full[32:48], k[:16])  # group 0: 2 q heads, k, v
    assert not torch.equal(full, torch.cat([q, k, v]))
    shards = [qkv.shard(full, r, 2) for r in range(2)]
    assert torch.equal(shards[1][:32], q[32:])  # rank 1 holds query group 1 whole
    for a, b in zip(qkv.split(qkv.unshard(shards)), (q, k, v), strict=True):
        assert torch.equal(a, b)
    fc1 = plan["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = torch.randn(128, 64), torch.randn(128, 64)
    rank1 = fc1.shard(fc1.merge([gate, up]), 1, 2)
    assert torch.equal(rank1, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(fc1.unshard([fc1.shard(fc1.merge([gate, up]), r, 2) for r in range(2)]), torch.cat([gate, up]))


def test_vocab_rows_are_padded_with_zeros_and_cut_back() -> None:
    emb = weight_plan(spec_of("qwen2"), 256)["embedding.word_embeddings.weight"]
    table = torch.randn(250, 64)
    full = emb.merge([table])
    assert full.shape == (256, 64) and full[250:].abs().sum() == 0
    assert torch.equal(emb.split(full)[0], table)
    assert padded_vocab_size(250, 1) == 256 and padded_vocab_size(4096, 2) == 4096 and padded_vocab_size(300, 4) == 512


def test_micro_batch_splits() -> None:
    assert split_by_count(5, 2) == [[0, 1], [2, 3], [4]]
    lengths = [10, 3, 8, 2, 7, 30]
    bins = split_by_token_budget(lengths, 20)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 20
    assert split_by_token_budget(lengths, 1000) == [[0, 1, 2, 3, 4, 5]]
    many = torch.randint(1, 300, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for packed in (False, True):
        assert split_by_token_budget(many, 1024, packed) == _first_fit_decreasing(many, 1024, packed)


def _first_fit_decreasing(lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """The definition, sizes recomputed from the members each time."""

    def size(rows: list[int]) -> int:
        return sum(lengths[i] for i in rows) if packed else len(rows) * max(lengths[i] for i in rows)

    bins: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = next((b for b in bins if size([*b, row]) <= budget), None)
        if fits is None:
            bins.append([row])
        else:
            fits.append(row)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
    with pytest.raises(ValueError, match="max_token_len"):
        split_by_token_budget(lengths, 0)


def test_align_left_points_at_the_logits_of_each_response_token() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [0, 4, 5, 6, 7, 8, 9]])
    mask = (ids > 0).long()
    assert aligned_length(mask, multiple=4) == 8
    aligned, positions, index = align_left(ids, mask, response_len=3, aligned_len=8)
    assert aligned.tolist() == [[5, 6, 7, 8, 0, 0, 0, 0], [4, 5, 6, 7, 8, 9, 0, 0]]
    assert positions[0].tolist() == list(range(8))
    responses = ids[:, -3:]
    for row in range(2):
        for j in range(3):
            if responses[row, j]:
                assert aligned[row, index[row, j] + 1] == responses[row, j]


def test_cpu_layer_checks_the_megatron_version() -> None:
    cpu_compat.check_megatron_version(cpu_compat.SUPPORTED_MEGATRON_CORE)
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1"):
        cpu_compat.check_megatron_version("0.15.0")
    assert cpu_compat.apply() is not torch.cuda.is_available()
    assert cpu_compat.is_applied() is not torch.cuda.is_available()


def test_fused_softmax_only_where_its_kernel_imports() -> None:
    # This machine has no apex: the fused masked softmax would import scaled_masked_softmax_cuda and fail.
    assert softmax_fusion_available(on_gpu=True) is False
    assert softmax_fusion_available(on_gpu=False) is False
    spec = model_spec(transformers.AutoConfig.from_pretrained(asset_path("models/tiny_dense")))
    assert transformer_config(spec, BuildOptions(layout=ParallelLayout(world_size=1))).masked_softmax_fusion is False


def test_transformer_impl_picks_the_layer_implementation() -> None:
    # TransformerEngine is not installed here: auto means local on CPU and on a GPU without it.
    assert use_transformer_engine("local", on_gpu=True) is False
    assert use_transformer_engine("auto", on_gpu=False) is False
    assert use_transformer_engine("auto", on_gpu=True) is False
    with pytest.raises(ValueError, match=r"needs transformer_engine \(pip install -e .\[gpu\]\)"):
        use_transformer_engine("transformer_engine", on_gpu=True)
    with pytest.raises(ValueError, match="needs a GPU; set transformer_impl=local or auto"):
        use_transformer_engine("transformer_engine", on_gpu=False)


class FusedNormLinear(torch.nn.Module):
    """Stands in for TE's `TELayerNormColumnParallelLinear` (no TE on CPU): the constructor MLA calls, its norm's
    eps taken from `config.layernorm_epsilon` as megatron-core 0.16.1's is."""

    def __init__(self, input_size: int, output_size: int, *, config: object, **_: object) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon  # type: ignore[attr-defined]
        self.config = config


def test_te_latent_norms_run_at_hfs_eps_whatever_rms_norm_eps(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's q/kv latent norms use a fixed 1e-6 (`DeepseekV3RMSNorm`'s default); under TE they are fused into the
    up projections, which megatron builds at the model's eps: the TE layer spec builds them at 1e-6 instead and
    leaves the model's config (its other norms) at rms_norm_eps."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megarl.models import mla

    def te_spec(**kwargs: object) -> object:  # the local MLA spec with the TE up projections' constructor
        local = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs, normalization="RMSNorm")  # type: ignore[arg-type]
        return mla._with_attention(local, linear_q_up_proj=FusedNormLinear, linear_kv_up_proj=FusedNormLinear)

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    config = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_deepseek_v3"), rms_norm_eps=1e-2)
    mcore = transformer_config(model_spec(config), BuildOptions(layout=ParallelLayout(world_size=1)))
    attention = mla.layer_spec(num_experts=None, use_te=True).submodules.self_attention.submodules
    for up in (attention.linear_q_up_proj, attention.linear_kv_up_proj):
        built = up(16, 32, config=mcore, init_method=None, gather_output=False, bias=False)
        assert isinstance(built, FusedNormLinear) and built.eps == mla.HF_LATENT_NORM_EPS == 1e-6
        assert built.config.num_layers == mcore.num_layers and built.config.kv_lora_rank == mcore.kv_lora_rank
    assert mcore.layernorm_epsilon == 1e-2
