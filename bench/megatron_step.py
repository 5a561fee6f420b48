"""RL training step vs a bare Megatron forward-backward on the same tokens (CPU, one process).

Both sides run the same GPTModel through megatron's schedule and the same optimizer step on the
same micro-batches. The RL side adds what an actor update needs: left-alignment, vocab-parallel
log-probs of the response tokens, the PPO loss and its metrics. Runs alternate (A, B, A, B, …)
and the script prints the ratio of medians (goal ≤ 1.05) and tokens/s.

    .venv/bin/python bench/megatron_step.py [--rows 8] [--seq 256] [--repeats 5]
"""

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _bare_step(engine, micros: list[dict]) -> None:
    def loss_func(micro: dict, output: torch.Tensor) -> tuple:
        labels = micro["aligned_ids"].roll(-1, dims=1)
        loss = F.cross_entropy(output.float().flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        return loss, torch.ones((), dtype=torch.int), {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        return model(micro["aligned_ids"], micro["position_ids"], None), partial(loss_func, micro)

    for chunk in engine.chunks:
        chunk.zero_grad_buffer()
    engine.trainable.optimizer.zero_grad()
    engine._schedule(
        forward_step_func=forward_step,
        data_iterator=iter(micros),
        model=engine.chunks[0],
        num_microbatches=len(micros),
        seq_length=micros[0]["aligned_ids"].shape[1],
        micro_batch_size=micros[0]["aligned_ids"].shape[0],
        forward_only=False,
        pg_collection=engine.groups.pgs,
    )
    engine.trainable.optimizer.step()


def run(model_dir: Path, rows: int, seq: int, repeats: int) -> dict[str, list[float]]:
    from cases.megatron_cases import sample_batch, with_training_columns

    from megarl.config.algorithm import AlgorithmConfig
    from megarl.config.training import OptimConfig
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.model import build_model
    from megarl.megatron.optim import make_trainable
    from megarl.megatron.parallel import ParallelLayout, build_role_groups
    from megarl.megatron.weights import SafetensorsReader, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(ParallelLayout(world_size=1))
    model = build_model(spec, groups)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-5), False, total_steps=100)
    engine = MegatronEngine(model, groups, trainable)
    batch = with_training_columns(sample_batch(spec.vocab_size, rows, seq // 2, seq // 2))
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])  # full rows: both sides see rows × seq
    batch["response_mask"] = batch["attention_mask"][:, seq // 2 :]
    batch["old_log_probs"] = torch.zeros(batch["responses"].shape)
    batching = MicroBatching(micro_batch_size=max(rows // 2, 1))
    micros = engine._micros(batch, batching)
    loss = PolicyLoss(AlgorithmConfig())
    times: dict[str, list[float]] = {"rl": [], "bare": []}
    for i in range(repeats + 1):
        start = time.perf_counter()
        _bare_step(engine, micros)
        bare = time.perf_counter() - start
        start = time.perf_counter()
        engine.train_step(batch, batching, loss)
        rl = time.perf_counter() - start
        if i:  # the first pair warms up
            times["bare"].append(bare)
            times["rl"].append(rl)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from cases.megatron_cases import save_random_model

    from megarl.megatron.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_model("qwen2", Path(tmp) / "qwen2", vocab_size=4096, num_layers=4)
        (times,) = spawn(run, 1, model_dir, args.rows, args.seq, args.repeats)
    rl, bare = statistics.median(times["rl"]), statistics.median(times["bare"])
    tokens = args.rows * args.seq
    print(f"tokens/step {tokens}  bare fwd-bwd {bare * 1e3:.1f} ms  RL step {rl * 1e3:.1f} ms")
    print(f"RL step / bare fwd-bwd = {rl / bare:.3f}   (goal <= 1.05)")
    print(f"RL step tokens/s = {tokens / rl:.0f}   bare tokens/s = {tokens / bare:.0f}")


if __name__ == "__main__":
    main()
