"""Check that a megatron checkpoint holds the same model as a Hugging Face directory.

Two checks: every tensor, streamed layer by layer and compared with the HF file, and the outputs of a few
fixed sequences from transformers against megatron-core loading the checkpoint through `dist_checkpointing`
(one process, TP=1): a causal LM's response log-probs, a sequence classifier's scores (`megarl.convert.classifier`:
its head at the last real token of left-padded rows of different lengths, transformers running each row alone).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megarl.convert.classifier import is_classifier
from megarl.convert.stream import iter_hf_tensors, spec_of
from megarl.megatron.weights import SafetensorsReader

if TYPE_CHECKING:
    from megarl.megatron.engine import MegatronEngine

NUM_PROMPTS = 3
PROMPT_LEN = 12
RESPONSE_LEN = 8
SCORED_LENGTHS = (20, 15, 9)
"""Real tokens of the rows a classifier scores (left-padded to the longest)."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    num_tensors: int
    mismatched: list[str]
    """`name: max |Δ|` for every tensor that differs (empty when all are identical)."""
    max_output_diff: float
    """The largest difference of the outputs compared (`outputs`)."""
    outputs: str = "log-probs"
    """`log-probs` (a causal LM's response tokens) | `scores` (a sequence classifier's)."""


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


def fixed_scored_rows(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) `[n, L]`: rows of `SCORED_LENGTHS` real tokens from a fixed seed, left-padded with 0 (no real
    token is 0)."""
    g = torch.Generator().manual_seed(1234)
    width = max(SCORED_LENGTHS)
    ids = torch.randint(1, vocab_size, (len(SCORED_LENGTHS), width), generator=g)
    mask = (torch.arange(width) >= width - torch.tensor(SCORED_LENGTHS).unsqueeze(1)).long()
    return ids * mask, mask


@torch.no_grad()
def hf_response_log_probs(hf_dir: str | Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()
    logits = model(input_ids=batch["input_ids"]).logits  # [b, s, v]
    r = batch["responses"].shape[1]
    return logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def hf_scores(hf_dir: str | Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' classifier logits `[n]`, each row run alone without its padding."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, attn_implementation="eager")
    model = model.float()
    rows = [row[keep.bool()].unsqueeze(0) for row, keep in zip(ids, mask, strict=True)]
    return torch.cat([model(input_ids=row).logits[:, 0] for row in rows])


def _tp1_engine(hf_config_dir: str, mcore_dir: str, value_head: bool) -> "MegatronEngine":
    """The checkpoint loaded at TP=1 on a rank of a 1-process world (see `megarl.megatron.launch.spawn`)."""
    from megarl.megatron.dist_ckpt import load_model
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import ParallelLayout, build_role_groups

    groups = build_role_groups(ParallelLayout(world_size=1))
    model = build_model(spec_of(hf_config_dir), groups, value_head=value_head)
    load_model(model.chunks, groups, mcore_dir)
    return MegatronEngine(model, groups)


def megatron_response_log_probs(hf_config_dir: str, mcore_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Runs on a rank of a 1-process world (see `megarl.megatron.launch.spawn`)."""
    from megarl.megatron.inputs import MicroBatching

    engine = _tp1_engine(hf_config_dir, mcore_dir, value_head=False)
    return engine.forward(batch, MicroBatching(micro_batch_size=NUM_PROMPTS))["log_probs"]


def megatron_scores(hf_config_dir: str, mcore_dir: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A classifier checkpoint's scores `[n]` (its value head at each row's last real token); on a rank of a
    1-process world."""
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.model import last_token_inputs

    engine = _tp1_engine(hf_config_dir, mcore_dir, value_head=True)
    return engine.forward(last_token_inputs(ids, mask), MicroBatching(micro_batch_size=len(ids)))["values"][:, 0]


def compare_tensors(hf_dir: str | Path, mcore_dir: str | Path, classifier: bool, atol: float) -> tuple[int, list[str]]:
    """(tensors compared, `name: problem` of each that differs by more than `atol`)."""
    reader = SafetensorsReader(hf_dir)
    mismatched = []
    num_tensors = 0
    for name, tensor in iter_hf_tensors(spec_of(hf_dir), mcore_dir, classifier):
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
    return num_tensors, mismatched


def output_diff(hf_dir: str | Path, mcore_dir: str | Path, classifier: bool) -> float:
    """The largest difference between transformers' and megatron's log-probs (classifier: scores)."""
    from megarl.megatron.launch import spawn

    vocab_size = spec_of(hf_dir).vocab_size
    if classifier:
        ids, mask = fixed_scored_rows(vocab_size)
        expected = hf_scores(hf_dir, ids, mask)
        (got,) = spawn(megatron_scores, 1, str(hf_dir), str(mcore_dir), ids, mask)
    else:
        batch = fixed_prompts(vocab_size)
        expected = hf_response_log_probs(hf_dir, batch)
        (got,) = spawn(megatron_response_log_probs, 1, str(hf_dir), str(mcore_dir), batch)
    return (got - expected).abs().max().item()


def verify(hf_dir: str | Path, mcore_dir: str | Path, atol: float = 0.0) -> VerifyReport:
    classifier = is_classifier(hf_dir)
    num_tensors, mismatched = compare_tensors(hf_dir, mcore_dir, classifier, atol)
    outputs = "scores" if classifier else "log-probs"
    return VerifyReport(num_tensors, mismatched, output_diff(hf_dir, mcore_dir, classifier), outputs)
