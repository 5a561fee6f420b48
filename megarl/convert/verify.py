"""Check that a megatron checkpoint holds the same model as a Hugging Face directory.

Two checks: every tensor, streamed layer by layer and compared with the HF file, and the
log-probs of a few fixed prompts from transformers against megatron-core loading the
checkpoint through `dist_checkpointing` (one process, TP=1).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.convert.stream import iter_hf_tensors, spec_of
from megarl.megatron.weights import SafetensorsReader

NUM_PROMPTS = 3
PROMPT_LEN = 12
RESPONSE_LEN = 8


@dataclass(frozen=True, slots=True)
class VerifyReport:
    num_tensors: int
    mismatched: list[str]
    """`name: max |Δ|` for every tensor that differs (empty when all are identical)."""
    max_log_prob_diff: float


def fixed_prompts(vocab_size: int) -> dict[str, torch.Tensor]:
    """NUM_PROMPTS token sequences (prompt + response) drawn from a fixed seed, no padding."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, vocab_size, (NUM_PROMPTS, PROMPT_LEN + RESPONSE_LEN), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": ids[:, PROMPT_LEN:],
        "response_mask": torch.ones(NUM_PROMPTS, RESPONSE_LEN, dtype=torch.long),
    }


@torch.no_grad()
def hf_response_log_probs(hf_dir: str | Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()
    logits = model(input_ids=batch["input_ids"]).logits  # [b, s, v]
    r = batch["responses"].shape[1]
    return logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def megatron_response_log_probs(hf_config_dir: str, mcore_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Runs on a rank of a 1-process world (see `megarl.megatron.launch.spawn`)."""
    from megarl.megatron.dist_ckpt import load_model
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import ParallelLayout, build_role_groups

    spec = spec_of(hf_config_dir)
    groups = build_role_groups(ParallelLayout(world_size=1))
    model = build_model(spec, groups)
    load_model(model.chunks, groups, mcore_dir)
    batching = MicroBatching(micro_batch_size=NUM_PROMPTS)
    return MegatronEngine(model, groups).forward(batch, batching)["log_probs"]


def verify(hf_dir: str | Path, mcore_dir: str | Path, atol: float = 0.0) -> VerifyReport:
    from megarl.megatron.launch import spawn

    spec = spec_of(hf_dir)
    reader = SafetensorsReader(hf_dir)
    mismatched = []
    num_tensors = 0
    for name, tensor in iter_hf_tensors(spec, mcore_dir):
        num_tensors += 1
        if name not in reader:
            mismatched.append(f"{name}: not in {hf_dir}")
            continue
        reference = reader.get(name)
        if reference.shape != tensor.shape:
            mismatched.append(f"{name}: shape {tuple(tensor.shape)} vs {tuple(reference.shape)}")
            continue
        diff = (reference.double() - tensor.double()).abs().max().item() if tensor.numel() else 0.0
        if diff > atol:
            mismatched.append(f"{name}: max |Δ| {diff:.3g}")
    batch = fixed_prompts(spec.vocab_size)
    expected = hf_response_log_probs(hf_dir, batch)
    (got,) = spawn(megatron_response_log_probs, 1, str(hf_dir), str(mcore_dir), batch)
    return VerifyReport(num_tensors, mismatched, (got - expected).abs().max().item())
