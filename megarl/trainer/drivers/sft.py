"""The SFT driver (`trainer.mode=sft`): the actor trained with cross-entropy on the assistant tokens of a chat
dataset, read top to bottom. No engines, no rewards.

Each step: a batch of `data.train_batch_size` conversations → the actor's supervised update (`ActorWorker.sft_update`:
mini-batches of `actor.ppo_mini_batch_size`, micro-batches packed or by token budget, DP shards balanced by tokens)
→ checkpoint when due → validation loss when due (`val/loss`: mean cross-entropy per assistant token of
`data.val_files`) → metrics. At the end the last checkpoint's actor is written as an HF checkpoint to `sft.hf_output`.
"""

import logging

import torch

from megarl.batch import Batch
from megarl.trainer.checkpoint import export_hf as checkpoint_hf
from megarl.trainer.collect import due
from megarl.trainer.job import SFTJob
from megarl.trainer.metrics import throughput, timer
from megarl.trainer.saving import finish, resume, save_checkpoint, settle_checkpoint
from megarl.trainer.tracking import ProgressBar
from megarl.trainer.train_step import forward, update
from megarl.workers.actor import ActorWorker

logger = logging.getLogger("megarl")


def fit_sft(job: SFTJob) -> None:
    """Train for `total_steps` steps from the latest checkpoint (or from the initial weights)."""
    cfg = job.cfg.trainer
    step = resume(job)
    if cfg.val_before_train and step == 0 and job.val_loader is not None:
        job.tracker.log(validation_loss(job), step)
    bar = ProgressBar(job.total_steps, step, disable=not cfg.progress_bar)
    while step < job.total_steps:
        step += 1
        last = step == job.total_steps
        timings: dict[str, float] = {}
        with timer("step", timings):
            batch = job.prompts.next()
            with timer("update_actor", timings):
                metrics = update(job.training, job.training.roles.actor, ActorWorker.sft_update, batch, step)
            if due(cfg.save_freq, step, last):
                with timer("save_checkpoint", timings):
                    save_checkpoint(job, step, metrics | timings)
            settle_checkpoint(job, blocking=last)
            if cfg.test_freq > 0 and due(cfg.test_freq, step, last) and job.val_loader is not None:
                with timer("testing", timings):
                    metrics |= validation_loss(job)
        metrics |= (
            timings
            | sft_data_metrics(batch)
            | throughput(batch["attention_mask"], timings["timing/step"], job.num_devices)
        )
        job.tracker.log(metrics, step)
        bar.update(step, metrics)
    bar.close()
    export_hf(job, step)
    finish(job)


def validation_loss(job: SFTJob) -> dict[str, float]:
    """`val/loss`: the actor's mean cross-entropy per assistant token over every validation conversation."""
    assert job.val_loader is not None
    total = count = 0.0
    for batch in job.val_loader:
        log_probs = forward(job.training, job.training.roles.actor, ActorWorker.compute_log_prob, batch)[
            "old_log_probs"
        ]
        mask = batch["response_mask"].to(log_probs.dtype)
        total += float(-(log_probs * mask).sum())
        count += float(mask.sum())
    return {"val/loss": total / max(count, 1.0), "val/tokens": count}


def sft_data_metrics(batch: Batch) -> dict[str, float]:
    """`sft/*`: the step's conversations, their tokens and the share of them that carry loss (assistant tokens)."""
    tokens = batch["attention_mask"].sum()
    trained = batch["response_mask"].sum()
    return {
        "sft/conversations": float(len(batch)),
        "sft/tokens": float(tokens),
        "sft/loss_token_share": float(trained / torch.clamp(tokens, min=1)),
    }


def export_hf(job: SFTJob, step: int) -> None:
    """The actor of the checkpoint at `step` as HF safetensors in `sft.hf_output`, with the config and tokenizer files
    of `model.path` (`checkpoint.export_hf`: a LoRA actor's adapters merged in); nothing when it is null."""
    out = job.cfg.sft.hf_output
    if out is None:
        return
    checkpoint = job.checkpoints.resolve("auto")
    if checkpoint is None or not checkpoint.name.endswith(f"_{step}"):
        raise RuntimeError(f"sft.hf_output: no checkpoint of step {step} to export (trainer.save_freq saves the last)")
    checkpoint_hf(checkpoint / "actor", job.cfg.model.path, lora=job.cfg.actor.lora.enabled, out=out)
    logger.info("sft: step %d's actor written as HF to %s", step, out)
