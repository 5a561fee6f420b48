"""`transformer_impl` on CUDA: TransformerEngine layers against the local ones and transformers, a converted
checkpoint loaded into TE layers, bf16 past 16 tokens (megatron's fused-softmax path where apex's
kernels import), and packed (THD) micro-batches through TE at TP2+SP and CP2 (2 GPUs). Skipped without a GPU;
the TE cases also without transformer_engine."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from cases.megatron_cases import hf_log_probs, sample_batch, save_random_model
from gpu_cases import BACKEND, needs_cuda, needs_device, record

from megarl.convert.stream import hf_to_mcore
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn
from megarl.megatron.parallel import ParallelLayout

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

Case = tuple[str, Path, Path | None, bool]
"""(name, HF model dir, dist checkpoint to load instead of the HF weights, use TE)."""


def rank_impl_log_probs(cases: list[Case], batch: dict[str, torch.Tensor], params_dtype: torch.dtype) -> dict:
    """Per case: build at TP1, load, response log-probs and the model's tensor keys in a dist checkpoint."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megarl.megatron.dist_ckpt import load_model, model_sharded_state_dict
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.weights import SafetensorsReader, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    groups = build_role_groups(ParallelLayout(world_size=1))
    out = {}
    for name, hf_dir, ckpt_dir, use_te in cases:
        model = build_model(model_spec(load_hf_config(hf_dir)), groups, params_dtype=params_dtype, use_te=use_te)
        if ckpt_dir is None:
            load_hf_weights(model, groups, SafetensorsReader(hf_dir))
        else:
            load_model(model.chunks, groups, ckpt_dir)
        sharded = model_sharded_state_dict(model.chunks, groups).values()
        keys = {s.key for s in sharded if isinstance(s, ShardedTensor | ShardedTensorFactory)}
        log_probs = MegatronEngine(model, groups).forward(batch, MicroBatching(micro_batch_size=8))["log_probs"]
        out[name] = (log_probs.cpu(), keys, model.config.masked_softmax_fusion)
    return out


@needs_cuda
@pytest.mark.skipif(not HAVE_TE, reason="needs transformer_engine")
def test_transformer_engine_matches_local_and_loads_converted_checkpoints(tmp_path: Path) -> None:
    batch = sample_batch(vocab_size=250)
    cases: list[Case] = []
    refs = {}
    for arch in ("qwen2", "qwen3_moe"):  # dense with qkv bias; qk norm and a MoE layer's pre-MLP TENorm
        hf_dir = save_random_model(arch, tmp_path / arch)
        hf_to_mcore(hf_dir, tmp_path / f"{arch}_mcore")
        refs[arch] = hf_log_probs(hf_dir, batch)
        cases += [(f"{arch}/local", hf_dir, None, False), (f"{arch}/te", hf_dir, None, True)]
        cases.append((f"{arch}/te_converted", hf_dir, tmp_path / f"{arch}_mcore", True))
    (result,) = spawn(rank_impl_log_probs, 1, cases, batch, torch.float32, backend="nccl")

    mask = batch["response_mask"].bool()
    for name, *_ in cases:
        arch = name.split("/")[0]
        log_probs, keys, _ = result[name]
        diff = (log_probs - refs[arch]).abs()[mask]
        record(f"transformer_impl/{name}", max=diff.max().item(), mean=diff.mean().item())
        assert diff.max().item() <= 2e-2 and diff.mean().item() <= 2e-3, f"{name}: max {diff.max().item()}"  # TF32
        assert keys == result[f"{arch}/local"][1], f"{name}: {keys ^ result[f'{arch}/local'][1]}"
    for arch in refs:
        assert torch.allclose(result[f"{arch}/te_converted"][0], result[f"{arch}/te"][0], atol=1e-6)


def rank_te_mla(hf_dir: Path, batch: dict[str, torch.Tensor]) -> dict:
    """A TE model of `hf_dir` at TP1: its fused q/kv up projections' norm eps (TE's `LayerNormLinear.eps`, which
    megatron's `split_te_layernorm_column_parallel_linear` reads too) and its response log-probs."""
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.weights import SafetensorsReader, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    groups = build_role_groups(ParallelLayout(world_size=1))
    model = build_model(model_spec(load_hf_config(hf_dir)), groups, params_dtype=torch.float32, use_te=True)
    load_hf_weights(model, groups, SafetensorsReader(hf_dir))
    ups = ("linear_q_up_proj", "linear_kv_up_proj")
    eps = {name: float(m.eps) for name, m in model.chunks[0].named_modules() if name.endswith(ups)}
    log_probs = MegatronEngine(model, groups).forward(batch, MicroBatching(micro_batch_size=8))["log_probs"]
    return {"eps": eps, "log_probs": log_probs.cpu()}


@needs_cuda
@pytest.mark.skipif(not HAVE_TE, reason="needs transformer_engine")
def test_te_mla_latent_norms_run_at_hfs_eps(tmp_path: Path) -> None:
    """HF's q/kv latent norms use a fixed 1e-6 whatever rms_norm_eps says; TE fuses them into the up projections,
    which megatron would build at rms_norm_eps (0.1 here, so a wrong eps moves the log-probs far past TF32's noise)."""
    hf_dir = save_random_model("deepseek_v3", tmp_path / "deepseek_v3")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.1}))
    batch = sample_batch(vocab_size=250)
    (out,) = spawn(rank_te_mla, 1, hf_dir, batch, backend="nccl")
    assert out["eps"] and set(out["eps"].values()) == {1e-6}, out["eps"]
    diff = (out["log_probs"] - hf_log_probs(hf_dir, batch)).abs()[batch["response_mask"].bool()]
    assert diff.max().item() <= 2e-2 and diff.mean().item() <= 2e-3, f"max {diff.max().item()}"


@needs_device
def test_bf16_log_probs_past_16_tokens(tmp_path: Path) -> None:
    # 8 rows × 4 heads and a longest row of 20: FusedScaleMaskSoftmax.is_kernel_available holds
    # (16 < sk, sq % 4 == 0, b·np % 4 == 0), so the fused kernel runs wherever apex's kernels import.
    batch = sample_batch(vocab_size=250, num_rows=8, prompt_len=12, response_len=12, seed=2)
    assert int(batch["attention_mask"].sum(dim=1).max()) == 20
    cases: list[Case] = []
    refs = {}
    for arch in ("qwen3", "qwen3_moe"):
        hf_dir = save_random_model(arch, tmp_path / arch, num_layers=4)
        refs[arch] = hf_log_probs(hf_dir, batch)
        cases += [(f"{arch}/local", hf_dir, None, False)] + ([(f"{arch}/te", hf_dir, None, True)] if HAVE_TE else [])
    (result,) = spawn(rank_impl_log_probs, 1, cases, batch, torch.bfloat16, backend=BACKEND)

    mask = batch["response_mask"].bool()
    for name, *_ in cases:
        log_probs, _, fused = result[name]
        diff = (log_probs - refs[name.split("/")[0]]).abs()[mask]
        message = f"{name} (masked_softmax_fusion={fused}): max {diff.max().item()}, mean {diff.mean().item()}"
        record(f"bf16_past_16_tokens/{name}", max=diff.max().item(), mean=diff.mean().item(), fused=fused)
        assert diff.max().item() <= 1.0 and diff.mean().item() <= 0.1, message


def rank_te_thd(hf_dir: Path, batch: dict[str, torch.Tensor], layouts: dict[str, ParallelLayout]) -> dict:
    """Per layout: TE layers' response log-probs packed (THD), and padded where the layout allows it (no CP)."""
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.weights import SafetensorsReader, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    out = {}
    for name, role_layout in layouts.items():
        groups = build_role_groups(role_layout)
        model = build_model(model_spec(load_hf_config(hf_dir)), groups, use_te=True)
        load_hf_weights(model, groups, SafetensorsReader(hf_dir))
        batching = MicroBatching(micro_batch_size=4)
        packings = (True,) if role_layout.cp > 1 else (True, False)
        for packing in packings:
            engine = MegatronEngine(model, groups, packing=packing)
            out[f"{name}/{'packed' if packing else 'padded'}"] = engine.forward(batch, batching)["log_probs"].cpu()
    return out


@pytest.mark.skipif(not HAVE_TE or torch.cuda.device_count() < 2, reason="needs transformer_engine and 2 GPUs")
def test_te_takes_thd_under_tp2_sequence_parallel_and_cp2(tmp_path: Path) -> None:
    """Packed micro-batches through TE's THD attention (its context-parallel attention at CP2) against the padded
    path and transformers."""
    hf_dir = save_random_model("qwen3", tmp_path / "qwen3", num_layers=4)
    batch = sample_batch(vocab_size=250)
    layouts = {
        "tp2sp": ParallelLayout(world_size=2, tp=2, sequence_parallel=True),
        "cp2": ParallelLayout(world_size=2, cp=2),
    }
    results = spawn(rank_te_thd, 2, hf_dir, batch, layouts, backend="nccl")
    mask = batch["response_mask"].bool()
    ref = hf_log_probs(hf_dir, batch)
    for name, log_probs in results[0].items():
        diff = (log_probs - ref).abs()[mask]
        record(f"te_thd/{name}", max=diff.max().item(), mean=diff.mean().item())
        assert diff.max().item() <= 2e-2 and diff.mean().item() <= 2e-3, f"{name}: max {diff.max().item()}"
    packed_vs_padded = (results[0]["tp2sp/packed"] - results[0]["tp2sp/padded"]).abs()[mask].max().item()
    assert packed_vs_padded <= 2e-2, packed_vs_padded
