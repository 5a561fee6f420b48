"""Checkpoint conversion throughput and peak memory, from the tiny models up to ~1 GB of weights.

For each model: write random HF safetensors (from the weight plan's names and shapes, no
transformers model), then in fresh processes, side by side:

- copy:        read every HF tensor and write it to new safetensors files with `safetensors.save_file`
               (the disk-bound floor)
- hf→mcore:    `megarl-convert hf-to-mcore`
- mcore→hf:    `megarl-convert mcore-to-hf`

(HF output in `--shard-mb` shards, 200 MB by default), in `--repeat` rounds, interleaved so that
every job meets the same load on a shared machine. Each row is a job's fastest run: seconds, CPU
seconds, GB/s, throughput as a fraction of the copy's; and its highest peak anonymous RSS growth,
sampled every millisecond (file-backed mmap pages of the files being read are left out: the kernel
can drop them), ÷ model size and ÷ (largest tensor + one shard). `dense_deep` has 40 layers:
streaming keeps its RSS near that of a shallow model, so both ratios stay well below 1 whatever the
depth. Each job starts with no dirty pages, and with the import-time objects frozen out of the
garbage collector: a full collection of them costs ~0.4 s, which is not conversion work.

    .venv/bin/python bench/convert_ckpt.py [--max-gb 1.1] [--repeat 3] [--shard-mb 200] [--work-dir DIR]
"""

import argparse
import gc
import importlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

MODELS = {
    # name: (layers, hidden, heads, kv heads, ffn, vocab, experts, moe ffn)
    "tiny_dense": (2, 64, 4, 2, 128, 4096, 0, 0),
    "tiny_moe": (2, 64, 4, 2, 128, 4096, 4, 32),
    "dense_250M": (12, 1024, 16, 4, 4096, 32000, 0, 0),
    "moe_270M": (8, 768, 12, 4, 2048, 32000, 16, 512),
    "dense_deep": (40, 640, 10, 2, 1792, 32000, 0, 0),
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


def save_sharded(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> int:
    """Plain sharded safetensors: hold up to `max_shard_bytes` of tensors, `save_file` them; returns the bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = total = 0
    for name, tensor in tensors:
        if shards[-1] and held + tensor.nbytes > max_shard_bytes:
            save_file(shards[-1], str(out / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards.append({})
            held = 0
        shards[-1][name] = tensor
        held += tensor.nbytes
        total += tensor.nbytes
    save_file(shards[-1], str(out / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    weight_map = {name: f"shard-{i:05d}.safetensors" for i, shard in enumerate(shards, 1) for name in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _random_tensors(name: str, out: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from megarl.models.spec import load_hf_config, model_spec
    from megarl.models.weight_map import padded_vocab_size, weight_plan

    spec = model_spec(load_hf_config(out))
    plan = weight_plan(spec, padded_vocab_size(spec.vocab_size, 1))
    g = torch.Generator().manual_seed(0)
    for mapping in plan.values():
        for hf_name, shape in zip(mapping.hf_names, mapping.hf_shapes, strict=True):
            yield hf_name, torch.randn(shape, generator=g)


def make_model(name: str, out: Path) -> tuple[int, int]:
    """Random HF safetensors for every name the weight plan expects; returns (bytes, largest tensor's bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(name)))
    largest = 0

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal largest
        for hf_name, tensor in _random_tensors(name, out):
            largest = max(largest, tensor.nbytes)
            yield hf_name, tensor

    return save_sharded(tracked(), out, max_shard_bytes=256 * 2**20), largest


class _Sampler(threading.Thread):
    """Samples this process's anonymous RSS every millisecond and keeps the peak."""

    def __init__(self) -> None:
        from megarl.convert.stream import anon_rss_bytes

        super().__init__(daemon=True)
        self.read = anon_rss_bytes
        self.start_bytes = self.peak = anon_rss_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self.read())


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(kind: str, src: str, dst: str, config_dir: str, shard_bytes: int) -> None:
    from megarl.convert.stream import hf_to_mcore, mcore_to_hf
    from megarl.megatron.weights import SafetensorsReader

    if kind == "copy":
        reader = SafetensorsReader(src)
        save_sharded(((name, reader.get(name)) for name in reader.names()), Path(dst), shard_bytes)
    elif kind == "hf→mcore":
        hf_to_mcore(src, dst)
    else:
        mcore_to_hf(src, config_dir, dst, max_shard_bytes=shard_bytes)


def _job(kind: str, src: str, dst: str, config_dir: str, shard_bytes: int, queue: mp.Queue) -> None:
    warnings.simplefilter("ignore", UserWarning)
    importlib.import_module("megarl.convert.stream")  # imports stay out of the timing
    from megarl.models.spec import load_hf_config

    load_hf_config(config_dir)  # first-use imports of transformers' config classes stay out of the timing
    gc.freeze()
    sampler = _Sampler()
    sampler.start()
    start, cpu = time.perf_counter(), _cpu_seconds()
    _run(kind, src, dst, config_dir, shard_bytes)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    sampler.done.set()
    sampler.join()
    queue.put((seconds, cpu, sampler.peak - sampler.start_bytes))


def measure(kind: str, src: Path, dst: Path, config_dir: Path, shard_bytes: int) -> tuple[float, float, int]:
    """(seconds, CPU seconds, peak RSS growth) of one job in a fresh process, which starts with no dirty pages
    (the earlier jobs' writes flushed): otherwise a job pays for the writeback of the ones before it."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_job, args=(kind, str(src), str(dst), str(config_dir), shard_bytes, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def _bench_model(name: str, work: Path, args: argparse.Namespace) -> None:
    """Round after round of the three jobs, so that each job meets the same load on a shared machine; each
    row is the fastest run of a job (its time and CPU time) and the highest peak RSS of its runs."""
    hf = work / name / "hf"
    size, largest = make_model(name, hf)
    if size / 1e9 > args.max_gb:
        print(f"{name:<12}{size / 1e9:>7.3f}  skipped (--max-gb {args.max_gb})")
        shutil.rmtree(work / name)
        return
    shard_bytes = int(args.shard_mb * 10**6)
    jobs = [("copy", hf, work / name / "copy"), ("hf→mcore", hf, work / name / "mcore")]
    jobs.append(("mcore→hf", work / name / "mcore", work / name / "back"))
    runs: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind, _, _ in jobs}
    for _ in range(args.repeat):
        for kind, src, dst in jobs:
            runs[kind].append(measure(kind, src, dst, hf, shard_bytes))
    copy_seconds = min(runs["copy"])[0]
    for kind, kind_runs in runs.items():
        seconds, cpu, _ = min(kind_runs)
        growth = max(run[2] for run in kind_runs)
        print(
            f"{name:<12}{size / 1e9:>7.3f}  {kind:<10}{seconds:>7.2f}{cpu:>7.2f}{size / 1e9 / seconds:>8.3f}"
            f"{copy_seconds / seconds:>8.2f}{growth / size:>10.3f}{growth / (largest + shard_bytes):>13.3f}"
        )
    shutil.rmtree(work / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-gb", type=float, default=1.1, help="skip models larger than this")
    parser.add_argument("--repeat", type=int, default=1, help="runs per job; the fastest is shown")
    parser.add_argument("--shard-mb", type=float, default=200, help="size of the safetensors shards written")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--work-dir", default="/tmp/megarl-bench-convert")
    args = parser.parse_args()
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"{'model':<12}{'GB':>7}  {'job':<10}{'s':>7}{'cpu s':>7}{'GB/s':>8}{'÷ copy':>8}"
        f"{'RSS÷size':>10}{'RSS÷(big+sh)':>13}"
    )
    for name in args.models:
        _bench_model(name, work, args)


if __name__ == "__main__":
    main()
