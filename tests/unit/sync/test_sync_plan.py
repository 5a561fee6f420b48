"""The sync planner's packing, the transforms' views and the delta hash, in one process."""

import pytest
import torch
import transformers
from cases.megatron_cases import ASSET_MODELS

from megarl.config.rollout import RolloutConfig
from megarl.engines.embedded.weights import named_weights, weight_slot
from megarl.models.spec import load_hf_config, model_spec
from megarl.models.weight_map import padded_vocab_size, weight_plan
from megarl.sync.build import engine_targets
from megarl.sync.delta import digest
from megarl.sync.plan import PlannedTensor, SyncPlan
from megarl.sync.transforms import hf_views, rank_parts


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("size", [1, 2])
def test_views_of_gathered_shards_are_the_hf_tensors(model: str, size: int) -> None:
    spec = model_spec(load_hf_config(ASSET_MODELS / model))
    plan = weight_plan(spec, padded_vocab_size=padded_vocab_size(spec.vocab_size, size))
    torch.manual_seed(0)
    for mapping in plan.values():
        hf = [torch.randn(shape) for shape in mapping.hf_shapes]
        full = mapping.merge(hf)
        split = mapping.tp_dim is not None
        gathered = torch.stack([mapping.shard(full, r, size) for r in range(size)]) if split else full[None]
        views = hf_views(mapping, gathered)
        assert len(views) == len(hf), mapping.mcore_name
        for view, expected in zip(views, hf, strict=True):
            assert torch.equal(view.reshape(expected.shape), expected), mapping.mcore_name
            assert view.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()  # no copy


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe", "tiny_qwen2_moe", "tiny_deepseek_v3"])
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("padding", [0, 64], ids=["unpadded", "padded"])
def test_each_ranks_parts_fill_the_hf_tensors_with_no_gather(model: str, size: int, padding: int) -> None:
    """Every rank writing its own shard (peer writes into the owner's bucket) gives what the gather gives."""
    spec = model_spec(load_hf_config(ASSET_MODELS / model))
    plan = weight_plan(spec, padded_vocab_size=padded_vocab_size(spec.vocab_size, size) + padding * size)
    torch.manual_seed(0)
    for mapping in plan.values():
        if mapping.tp_dim is None or (mapping.qkv_groups and mapping.qkv_groups[0] % size):
            continue  # replicated, or more TP ranks than query groups (megatron-core refuses that layout)
        hf = [torch.randn(shape) for shape in mapping.hf_shapes]
        full = mapping.merge(hf)
        slots = [torch.full(shape, float("nan")) for shape in mapping.hf_shapes]
        for rank in range(size):
            shard = mapping.shard(full, rank, size)
            for dest, src in rank_parts(mapping, shard, slots, size, rank):
                assert dest.untyped_storage().data_ptr() in {s.untyped_storage().data_ptr() for s in slots}
                assert src.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()  # views, no copy
                dest.copy_(src)
        for slot, expected in zip(slots, hf, strict=True):
            assert torch.equal(slot, expected), mapping.mcore_name  # every element written (no NaN left)


def _tensor(name: str, owner: int, nbytes: int, dtype: torch.dtype = torch.float32) -> PlannedTensor:
    return PlannedTensor(name, owner, (name,), ((nbytes // dtype.itemsize,),), nbytes, dtype)


def test_buckets_respect_the_size_take_owners_in_turn_and_filter() -> None:
    tensors = [_tensor(f"a{i}", 0, 40) for i in range(5)] + [_tensor("b0", 1, 150), _tensor("b1", 1, 30)]
    plan = SyncPlan(tuple(tensors), bucket_bytes=100)
    buckets = plan.buckets()
    assert [(b.owner, [t.mcore_name for t in b.tensors]) for b in buckets] == [
        (0, ["a0", "a1"]),
        (1, ["b0"]),  # larger than a bucket: alone
        (0, ["a2", "a3"]),
        (1, ["b1"]),
        (0, ["a4"]),
    ]
    assert [b.index for b in buckets] == list(range(5))
    assert all(b.nbytes <= 100 or len(b.tensors) == 1 for b in buckets)
    assert plan.largest_tensor_bytes == 150 and plan.owners == [0, 1]
    changed = plan.buckets(include={"a3", "b1"})
    assert [[t.mcore_name for t in b.tensors] for b in changed] == [["a3"], ["b1"]]
    assert "bucket 0 from rank 0 (2 tensors" in buckets[0].describe()


def test_a_bucket_holds_one_dtype_and_views_it_in_a_byte_buffer() -> None:
    """fp32 tensors (the expert bias HF keeps in fp32) among bf16 ones get buckets of their own, packed together;
    each bucket reads its tensors from the front of a byte buffer in its dtype."""
    bf16, fp32 = torch.bfloat16, torch.float32
    tensors = [_tensor("w0", 0, 40, bf16), _tensor("bias0", 0, 16, fp32), _tensor("w1", 0, 40, bf16)]
    tensors += [_tensor("bias1", 0, 16, fp32), _tensor("w2", 0, 40, bf16)]
    buckets = SyncPlan(tuple(tensors), bucket_bytes=100).buckets()
    assert [([t.mcore_name for t in b.tensors], b.dtype, b.nbytes) for b in buckets] == [
        (["w0", "w1"], bf16, 80),
        (["bias0", "bias1"], fp32, 32),
        (["w2"], bf16, 40),
    ]
    buffer = torch.zeros(100, dtype=torch.uint8)
    (name, bias0), (_, bias1) = buckets[1].views(buckets[1].typed(buffer))
    assert name == "bias0" and bias0.dtype == bias1.dtype == fp32 and bias0.shape == bias1.shape == (4,)
    bias1.fill_(1.5)
    assert torch.equal(buffer[16:32].view(fp32), torch.full((4,), 1.5)) and not buffer[32:].any()


def test_the_expert_bias_is_planned_in_fp32() -> None:
    spec = model_spec(load_hf_config(ASSET_MODELS / "tiny_deepseek_v3"))
    plan = weight_plan(spec, padded_vocab_size=padded_vocab_size(spec.vocab_size, 1))
    expected = {f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)}  # the MoE layers
    assert {name for name, mapping in plan.items() if mapping.keep_fp32} == expected


def test_digest_changes_with_any_element() -> None:
    t = torch.randn(1000)
    same = t.clone()
    assert digest(t) == digest(same)
    same[999] += 1e-6
    assert digest(t) != digest(same)
    assert digest(t.to(torch.bfloat16)) != digest(t)


@pytest.mark.parametrize(
    ("model_type", "extra", "expert_name", "router_name"),
    [
        ("qwen3_moe", {"num_experts": 3, "moe_intermediate_size": 8}, "mlp.experts.{e}.{p}.weight", "mlp.gate.weight"),
        (
            "mixtral",
            {"num_local_experts": 3},
            "block_sparse_moe.experts.{e}.{p}.weight",
            "block_sparse_moe.gate.weight",
        ),
    ],
)
def test_engine_fills_fused_experts_from_per_expert_names(
    model_type: str, extra: dict, expert_name: str, router_name: str
) -> None:
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, **extra,
    )  # fmt: skip
    weights = named_weights(transformers.AutoModelForCausalLM.from_config(config))
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if model_type == "qwen3_moe" else ("w1", "w3", "w2")
    fused = weights["model.layers.0.mlp.experts.gate_up_proj"].data
    half = fused.shape[1] // 2
    prefix = "model.layers.0."
    assert weight_slot(weights, prefix + expert_name.format(e=1, p=gate)).data_ptr() == fused[1, :half].data_ptr()
    assert weight_slot(weights, prefix + expert_name.format(e=2, p=up)).data_ptr() == fused[2, half:].data_ptr()
    down_slot = weight_slot(weights, prefix + expert_name.format(e=1, p=down))
    assert down_slot.data_ptr() == weights["model.layers.0.mlp.experts.down_proj"].data[1].data_ptr()
    assert weight_slot(weights, prefix + router_name) is not None
    with pytest.raises(KeyError):
        weight_slot(weights, prefix + "mlp.experts.1.nonsense.weight")


def test_engine_targets_count_sglang_tp_ranks() -> None:
    sglang = engine_targets(RolloutConfig(engine="sglang", tensor_parallel_size=4), ["http://a:1", "http://b:1"])
    assert [(t.url, t.ranks) for t in sglang] == [("http://a:1", 4), ("http://b:1", 4)]
    assert engine_targets(RolloutConfig(engine="embedded"), ["http://a:1"])[0].ranks == 1
