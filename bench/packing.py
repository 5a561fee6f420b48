"""Padded vs packed micro-batches on a long-tailed mix of lengths (CPU, one process, the same rows both ways).

RL response lengths are long-tailed: most rows short, a few near the limit. The rows here: lognormal lengths
(median `--median` tokens, σ = 1) plus `--long` rows of `--long-len` tokens, shuffled. Both sides run the same
engine's PPO training step on the same rows, split the same way (`--micro-batch-size` rows per micro-batch, or
`--budget` tokens with use_dynamic_bsz: rows × longest padded, real tokens packed); steps alternate (padded,
packed, …) after one warm-up pair. Prints the median step time of each side and their ratio (goal ≥ 1.5×), and
computed ÷ real tokens from the engine's `packing/*` metrics (goal ≤ 1.05 packed).

    .venv/bin/python bench/packing.py [--rows 32] [--median 64] [--long 2] [--long-len 1024] [--repeats 2] [--budget N]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
SIDES = ("padded", "packed")


def long_tail_batch(args: argparse.Namespace, vocab_size: int) -> dict[str, torch.Tensor]:
    """Rows of one prompt token (left-padded) and a long-tailed response (right-padded); ids random."""
    g = torch.Generator().manual_seed(0)
    short = torch.exp(torch.randn(args.rows - args.long, generator=g) + torch.log(torch.tensor(float(args.median))))
    lengths = torch.cat([short.round().clamp(2, args.long_len).long(), torch.full((args.long,), args.long_len)])
    lengths = lengths[torch.randperm(args.rows, generator=g)]
    width = int(lengths.max())
    cols = torch.arange(width)
    response_mask = (cols.unsqueeze(0) < lengths.unsqueeze(1) - 1).long()
    attention_mask = torch.cat([torch.ones(args.rows, 1, dtype=torch.long), response_mask[:, :-1]], dim=1)
    input_ids = torch.randint(1, vocab_size, (args.rows, width), generator=g) * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, 1:],
        "response_mask": response_mask[:, :-1],
        "advantages": torch.randn(args.rows, width - 1, generator=g),
        "old_log_probs": torch.zeros(args.rows, width - 1),
    }


def run(model_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
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
    trainable = make_trainable(model, groups, OptimConfig(lr=1e-7), False, total_steps=100)
    engines = {side: MegatronEngine(model, groups, trainable, packing=side == "packed") for side in SIDES}
    batch = long_tail_batch(args, spec.vocab_size)
    if args.budget:
        batching = MicroBatching(use_dynamic_bsz=True, max_token_len=args.budget)
    else:
        batching = MicroBatching(micro_batch_size=args.micro_batch_size)
    loss = PolicyLoss(AlgorithmConfig())
    out: dict[str, dict[str, list[float]]] = {side: {"s": [], "computed": [], "real": []} for side in engines}
    for i in range(args.repeats + 1):
        for side, engine in engines.items():
            start = time.perf_counter()
            metrics = engine.train_step(batch, batching, loss)
            if i:  # the first pair warms up
                out[side]["s"].append(time.perf_counter() - start)
                out[side]["computed"].append(metrics["packing/computed_tokens"])
                out[side]["real"].append(metrics["packing/real_tokens"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--long", type=int, default=2)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=0, help="use_dynamic_bsz with this max_token_len")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from cases.megatron_cases import save_random_model

    from megarl.megatron.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_model("qwen2", Path(tmp) / "qwen2", vocab_size=4096, num_layers=4)
        (result,) = spawn(run, 1, model_dir, args)
    medians = {side: statistics.median(values["s"]) for side, values in result.items()}
    split = f"max_token_len {args.budget}" if args.budget else f"{args.micro_batch_size} rows per micro-batch"
    print(f"{args.rows} rows ({args.long} of {args.long_len} tokens, median {args.median}), {split}")
    for side, values in result.items():
        real, computed = values["real"][0], values["computed"][0]
        ratio = computed / real
        print(f"{side:>6}: step {medians[side]:.3f} s   computed {computed:.0f} / real {real:.0f} = {ratio:.2f}")
    print(f"packed is {medians['padded'] / medians['packed']:.2f}× faster (goal ≥ 1.5)")


if __name__ == "__main__":
    main()
