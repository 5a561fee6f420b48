"""Reward models on CUDA: the discriminative RM as a Megatron role (one rank over NCCL, padded and packed, released
and restored) and the embedded engine's `/classify` on the GPU, against transformers' classifier on the CPU.
Skipped without a GPU; `device_check.sh --dry` rehearses both on the CPU."""

import asyncio
from pathlib import Path

import torch
from cases.engine_cases import start_engine
from cases.reward_cases import CONVERSATIONS, hf_classifier_scores, rank_rm_scores, rm_rows, save_classifier
from gpu_cases import BACKEND, DEVICE, needs_device, record

from megarl.config.reward import DiscriminativeRMConfig
from megarl.config.training import MegatronConfig
from megarl.megatron.launch import spawn
from megarl.rewards.sources import Trajectory
from megarl.scoring.classify import ClassifierSource

TOLERANCE = 1e-2
"""TF32 matmuls on the GPU (the CPU runs agree within 1e-6)."""


@needs_device
def test_megatron_rm_scores_match_transformers(tmp_path: Path) -> None:
    model_dir = save_classifier(tmp_path / "rm")
    ids, mask = rm_rows(model_dir)
    expected, _ = hf_classifier_scores(model_dir, ids, mask)
    cases = [(name, MegatronConfig(sequence_packing=name == "packed"), 4096) for name in ("padded", "packed")]
    (result,) = spawn(rank_rm_scores, 1, model_dir, cases, ids, mask, DEVICE, backend=BACKEND)
    for name in ("padded", "packed", "padded+restored"):
        diff = (result[name] - expected.detach()).abs().max().item()
        record(f"reward/rm_{name}", max=diff)
        assert diff <= TOLERANCE, (name, result[name], expected)
    assert result["released_bytes"] > 0


async def _scores(cfg: DiscriminativeRMConfig, url: str) -> list[float]:
    source = ClassifierSource(cfg, [url])
    trajectories = [
        Trajectory(data_source="t", messages=c, prompt_messages=c[:-1], response_text="", ground_truth="")
        for c in CONVERSATIONS
    ]
    try:
        return [component.value for component in await asyncio.gather(*map(source.score, trajectories))]
    finally:
        await source.close()


@needs_device
def test_embedded_classify_on_the_device_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_classifier(tmp_path / "rm")
    ids, mask = rm_rows(model_dir)
    expected, _ = hf_classifier_scores(model_dir, ids, mask)
    server, url = start_engine(model_dir, tmp_path, "--is-embedding", "--device", DEVICE, "--dtype", "float32")
    try:
        cfg = DiscriminativeRMConfig(enable=True, path=str(model_dir), backend="server")
        scores = torch.tensor(asyncio.run(_scores(cfg, url)))
    finally:
        server.stop()
    diff = (scores - expected.detach()).abs().max().item()
    record("reward/embedded_classify", max=diff)
    assert diff <= TOLERANCE, (scores, expected)
