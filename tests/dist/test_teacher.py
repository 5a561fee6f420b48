"""The on-policy distillation teacher both ways: `TeacherWorker` (a Megatron role, 2 gloo ranks, TP2 packed, offloaded
and restored) and `TeacherScorer` (prefill on an embedded engine, SGLang's input log-probs) give the same log-prob of
every response token of the same rows."""

import asyncio
from pathlib import Path

import torch
import transformers
from cases.engine_cases import save_engine_model, start_engine

from megarl.assets import asset_path
from megarl.batch import Batch
from megarl.config.model import ModelConfig
from megarl.config.reward import RetryConfig
from megarl.config.training import MegatronConfig
from megarl.data.sft import collate_sft
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn
from megarl.scoring.teacher import TeacherEngines, TeacherScorer
from megarl.workers.settings import ModelSettings, TeacherSettings

CHATS = [("What is 2 + 3?", "2 + 3 = 5."), ("Name a prime.", "7"), ("Hi", "Hello! How can I help you today?")]


def _rows() -> list[dict[str, list[int]]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    pairs = [(tokenizer.encode(q), tokenizer.encode(a)) for q, a in CHATS]
    return [{"prompt_ids": p, "response_ids": r, "response_mask": [1] * len(r)} for p, r in pairs]


def rank_teacher_log_probs(model_dir: Path, batch: Batch) -> dict[str, object]:
    """On every rank: a `TeacherWorker` at TP2 (packed, offloading) scoring `batch`, before and after release."""
    from megarl.workers.teacher import TeacherWorker

    worker = TeacherWorker(torch.distributed.get_rank(), torch.distributed.get_world_size(), "cpu")
    megatron = MegatronConfig(tensor_model_parallel_size=2, sequence_packing=True)
    model = ModelSettings(
        model=ModelConfig(path=str(model_dir), dtype="float32"), megatron=megatron, weights_path=str(model_dir), seed=0
    )
    worker.setup(TeacherSettings(model=model, micro=MicroBatching(2), temperature=1.0, offload=True))
    first = worker.compute_teacher_log_prob(batch)["teacher_log_probs"]
    released = worker.release()["offload/bytes"]
    worker.restore()
    again = worker.compute_teacher_log_prob(batch)["teacher_log_probs"]
    return {"log_probs": first, "released": released, "again": again}


async def _engine_log_probs(url: str, rows: list[dict[str, list[int]]]) -> list[list[float]]:
    scorer = TeacherScorer(TeacherEngines(urls=[url], keys=None, retry=RetryConfig(), concurrency=2))
    try:
        return list(await asyncio.gather(*(scorer.log_probs(r["prompt_ids"], r["response_ids"]) for r in rows)))
    finally:
        await scorer.close()


def test_megatron_teacher_and_engine_teacher_agree(tmp_path: Path) -> None:
    model_dir = save_engine_model(tmp_path / "teacher", hidden=64, layers=2)
    rows = _rows()
    server, url = start_engine(model_dir, tmp_path)
    try:
        engine = asyncio.run(_engine_log_probs(url, rows))
    finally:
        server.stop()
    batch = collate_sft(rows, pad_token_id=0)
    results = spawn(rank_teacher_log_probs, 2, model_dir, batch)
    for result in results:
        assert result["released"] > 0 and torch.equal(result["again"], result["log_probs"])
        megatron = result["log_probs"]
        for i, row in enumerate(rows):
            n = len(row["response_ids"])
            assert len(engine[i]) == n and megatron[i, n:].abs().sum() == 0
            diff = (megatron[i, :n] - torch.tensor(engine[i])).abs().max().item()
            assert diff <= 1e-4, f"row {i}: max |Δ log p| = {diff}"
            assert megatron[i, :n].abs().max() > 0.5  # random weights: the tokens are far from certain
