"""The colocated hand-over on CUDA: an offload gives its memory back to the device, not only to torch's caching
allocator (where a waking SGLang engine could not allocate it). Skipped without a GPU."""

from pathlib import Path

import torch
from cases.megatron_cases import layout, rank_offload_round_trip, sample_batch, save_random_model, with_training_columns
from gpu_cases import needs_cuda, record

from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.megatron.launch import spawn

pytestmark = needs_cuda


def test_an_offload_lowers_the_memory_reserved_on_the_device(tmp_path: Path) -> None:
    """bf16 parameters, fp32 gradients, masters and Adam moments of a ~70M-parameter model: large blocks, each in
    segments of its own that `empty_cache` can return."""
    model_dir = save_random_model("qwen2", tmp_path / "qwen2", num_layers=4, hidden_size=1024, intermediate_size=4096)
    batch = with_training_columns(sample_batch(vocab_size=250, num_rows=8))
    adam = OptimConfig(name="adam", lr=1e-4, weight_decay=0.0, clip_grad=1.0)
    args = (model_dir, layout(1), batch, AlgorithmConfig(), adam, torch.bfloat16)
    memory = spawn(rank_offload_round_trip, 1, *args, backend="nccl")[0]["memory"]
    before, after = memory["reserved"]
    record("offload/reserved_bytes", before=before, after=after, freed=memory["freed"])
    assert memory["freed"] > 500 * 2**20
    assert before - after >= 0.5 * memory["freed"], (before, after, memory["freed"])  # no drop at all when kept cached
    assert memory["during"] == {"params": 0, "grads": 0, "optimizer": 0} and memory["master_during"] == 0
