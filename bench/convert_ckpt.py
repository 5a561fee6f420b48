"""Checkpoint conversion throughput and peak memory, from the tiny models up to ~1 GB of weights.

For each model: write random HF safetensors (from the weight plan's names and shapes, no
transformers model), then in fresh processes, side by side:

- copy:        read every HF tensor and write it to new safetensors files (the disk-bound floor)
- hf→mcore:    `megarl-convert hf-to-mcore`
- mcore→hf:    `megarl-convert mcore-to-hf`

(HF output in 200 MB shards) and print GB/s, each job's time relative to the copy, and peak
anonymous RSS growth ÷ model size, sampled every millisecond (file-backed mmap pages of the
files being read are left out: the kernel can drop them). Streaming keeps the ratio near
(largest layer + one 200 MB shard) ÷ model size, well below 1 for large models.

    .venv/bin/python bench/convert_ckpt.py [--max-gb 1.1] [--work-dir /tmp/megarl-bench-convert]
"""

import argparse
import multiprocessing as mp
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

SHARD_BYTES = 200 * 10**6
MODELS = {
    # name: (layers, hidden, heads, kv heads, ffn, vocab, experts, moe ffn)
    "tiny_dense": (2, 64, 4, 2, 128, 4096, 0, 0),
    "tiny_moe": (2, 64, 4, 2, 128, 4096, 4, 32),
    "dense_250M": (12, 1024, 16, 4, 4096, 32000, 0, 0),
    "moe_270M": (8, 768, 12, 4, 2048, 32000, 16, 512),
}


def _config(name: str) -> dict:
    layers, hidden, heads, kv, ffn, vocab, experts, moe_ffn = MODELS[name]
    base = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    if experts:
        return {
            **base,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "head_dim": hidden // heads,
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": moe_ffn,
            "norm_topk_prob": True,
            "attention_bias": False,
        }
    return {**base, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def make_model(name: str, out: Path) -> int:
    """Random HF safetensors for every name the weight plan expects; returns the bytes written."""
    import json

    from megarl.checkpoint.hf_io import ShardedSafetensorsWriter
    from megarl.models.spec import load_hf_config, model_spec
    from megarl.models.weight_map import padded_vocab_size, weight_plan

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(name)))
    spec = model_spec(load_hf_config(out))
    plan = weight_plan(spec, padded_vocab_size(spec.vocab_size, 1))
    g = torch.Generator().manual_seed(0)
    with ShardedSafetensorsWriter(out, max_shard_bytes=256 * 2**20) as writer:
        for mapping in plan.values():
            for hf_name, shape in zip(mapping.hf_names, mapping.hf_shapes, strict=True):
                writer.add(hf_name, torch.randn(shape, generator=g))
    return writer.total_bytes


class _Sampler(threading.Thread):
    """Samples this process's anonymous RSS every millisecond and keeps the peak."""

    def __init__(self) -> None:
        from megarl.checkpoint.convert import anon_rss_bytes

        super().__init__(daemon=True)
        self.read = anon_rss_bytes
        self.start_bytes = self.peak = anon_rss_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self.read())


def _job(kind: str, src: str, dst: str, config_dir: str, queue: mp.Queue) -> None:
    warnings.simplefilter("ignore", UserWarning)
    from megarl.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from megarl.checkpoint.hf_io import ShardedSafetensorsWriter
    from megarl.megatron.weights import SafetensorsReader
    from megarl.models.spec import load_hf_config

    load_hf_config(config_dir)  # first-use imports of transformers' config classes stay out of the timing
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    if kind == "copy":
        reader = SafetensorsReader(src)
        with ShardedSafetensorsWriter(dst, max_shard_bytes=SHARD_BYTES) as writer:
            for name in reader.names():
                writer.add(name, reader.get(name))
    elif kind == "hf→mcore":
        hf_to_mcore(src, dst)
    else:
        mcore_to_hf(src, config_dir, dst, max_shard_bytes=SHARD_BYTES)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    queue.put((seconds, sampler.peak - sampler.start_bytes))


def measure(kind: str, src: Path, dst: Path, config_dir: Path) -> tuple[float, int]:
    """(seconds, peak RSS growth) of one job in a fresh process."""
    shutil.rmtree(dst, ignore_errors=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_job, args=(kind, str(src), str(dst), str(config_dir), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-gb", type=float, default=1.1, help="skip models larger than this")
    parser.add_argument("--work-dir", default="/tmp/megarl-bench-convert")
    args = parser.parse_args()
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'model':<12}{'GB':>7}  {'job':<10}{'s':>7}{'GB/s':>8}{'÷ copy':>8}{'RSS ÷ size':>12}")
    for name in MODELS:
        hf = work / name / "hf"
        size = make_model(name, hf)
        if size / 1e9 > args.max_gb:
            print(f"{name:<12}{size / 1e9:>7.3f}  skipped (--max-gb {args.max_gb})")
            shutil.rmtree(work / name)
            continue
        jobs = [("copy", hf, work / name / "copy"), ("hf→mcore", hf, work / name / "mcore")]
        jobs.append(("mcore→hf", work / name / "mcore", work / name / "back"))
        copy_seconds = None
        for kind, src, dst in jobs:
            seconds, growth = measure(kind, src, dst, hf)
            copy_seconds = copy_seconds or seconds
            print(
                f"{name:<12}{size / 1e9:>7.3f}  {kind:<10}{seconds:>7.2f}{size / 1e9 / seconds:>8.3f}"
                f"{seconds / copy_seconds:>8.2f}{growth / size:>12.3f}"
            )
        shutil.rmtree(work / name)


if __name__ == "__main__":
    main()
