"""LoRA on CUDA: adapters on megatron's local and TransformerEngine layers (TE fuses the input norm into
`linear_qkv` and `linear_fc1`, so the adapter reads the normalised input its hook computes) against peft on
transformers, and the adapters-off pass against the base. Skipped without a GPU; the TE case also without
transformer_engine."""

import importlib.util
from pathlib import Path

import torch
from cases.lora_cases import TARGETS, peft_token_log_probs, save_random_adapter
from cases.megatron_cases import sample_batch, save_random_model
from gpu_cases import needs_cuda, record

from megarl.megatron.launch import spawn
from megarl.megatron.parallel import ParallelLayout

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def rank_adapter_impls(hf_dir: Path, adapter_dir: Path, batch: dict[str, torch.Tensor]) -> dict:
    """Per layer implementation at TP1: response log-probs with the adapter loaded, and with it off."""
    from megarl.config.lora import LoraConfig
    from megarl.lora.model import adapters_disabled, apply_lora
    from megarl.lora.peft_io import load_adapter_tensors, read_peft
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.weights import SafetensorsReader, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    groups = build_role_groups(ParallelLayout(world_size=1))
    _, tensors = read_peft(adapter_dir)
    out = {}
    for name, use_te in (("local", False), ("te", True))[: 2 if HAVE_TE else 1]:
        model = build_model(model_spec(load_hf_config(hf_dir)), groups, params_dtype=torch.float32, use_te=use_te)
        load_hf_weights(model, groups, SafetensorsReader(hf_dir))
        model = apply_lora(model, groups, LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS), seed=0)
        load_adapter_tensors(model, tensors, str(adapter_dir))
        engine = MegatronEngine(model, groups, packing=True)
        with adapters_disabled(model):
            off = engine.forward(batch, MicroBatching(micro_batch_size=8))["log_probs"].cpu()
        out[name] = (engine.forward(batch, MicroBatching(micro_batch_size=8))["log_probs"].cpu(), off)
    return out


@needs_cuda
def test_adapters_on_local_and_te_layers_match_peft(tmp_path: Path) -> None:
    batch = sample_batch(vocab_size=250)
    hf_dir = save_random_model("qwen2", tmp_path / "qwen2")
    adapter_dir = save_random_adapter(hf_dir, tmp_path / "adapter", 4, TARGETS)
    ref, base = peft_token_log_probs(hf_dir, adapter_dir, batch), peft_token_log_probs(hf_dir, None, batch)
    (result,) = spawn(rank_adapter_impls, 1, hf_dir, adapter_dir, batch, backend="nccl")
    mask = batch["response_mask"].bool()
    for name, (with_adapter, off) in result.items():
        diff, off_diff = (with_adapter - ref).abs()[mask], (off - base).abs()[mask]
        record(f"lora/{name}", max=diff.max().item(), off_max=off_diff.max().item())
        assert diff.max().item() <= 2e-2 and diff.mean().item() <= 2e-3, f"{name}: max {diff.max().item()}"  # TF32
        assert off_diff.max().item() <= 2e-2, f"{name} adapters off: max {off_diff.max().item()}"
