"""The transformers parity test on CUDA + NCCL (fp32 and bf16); skipped without a GPU (on CPU over gloo under
device_check.sh --dry)."""

from pathlib import Path

import pytest
import torch
from cases.megatron_cases import hf_log_probs, layout, rank_log_probs, sample_batch, save_random_model
from gpu_cases import BACKEND, CUDA, needs_device, record

from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn

pytestmark = needs_device


@pytest.mark.parametrize(
    ("params_dtype", "max_tol", "mean_tol"), [(torch.float32, 1e-3, 1e-4), (torch.bfloat16, 1.0, 0.1)]
)
def test_log_probs_match_transformers_on_cuda(
    tmp_path: Path, params_dtype: torch.dtype, max_tol: float, mean_tol: float
) -> None:
    world = min(torch.cuda.device_count(), 2) if CUDA else 1
    batch = sample_batch(vocab_size=250)
    cases, refs = [], {}
    for arch in ("qwen2", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3"):
        model_dir = save_random_model(arch, tmp_path / arch, num_layers=4)
        refs[arch] = hf_log_probs(model_dir, batch)
        cases.append((f"{arch}/tp{world}", model_dir, layout(world, tp=world, **({"ep": 1} if "moe" in arch else {}))))
    batching = MicroBatching(micro_batch_size=4)
    results = spawn(rank_log_probs, world, cases, batch, batching, params_dtype, (), True, backend=BACKEND)
    mask = batch["response_mask"].bool()
    for name, _, _ in cases:
        for packed in ("", "+packed"):  # packed: THD through TE's attention (the local spec's on CPU)
            diff = (results[0][name + packed]["log_probs"] - refs[name.split("/")[0]]).abs()[mask]
            record(f"parity/{name}{packed}/{params_dtype}", max=diff.max().item(), mean=diff.mean().item())
            assert diff.max().item() <= max_tol, f"{name}{packed}: max {diff.max().item()}"
            assert diff.mean().item() <= mean_tol, f"{name}{packed}: mean {diff.mean().item()}"
