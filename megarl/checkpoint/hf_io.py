"""Write a Hugging Face model directory: sharded safetensors with an index, plus config and tokenizer files.

`ShardedSafetensorsWriter` holds at most one output shard in memory: tensors are added one by
one and a shard file is written when the next tensor would overflow it. Files go to a
temporary name first, so a killed conversion never leaves a complete-looking shard.

Usage::

    with ShardedSafetensorsWriter(out_dir, max_shard_bytes=2**30) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
    copy_model_files(hf_config_dir, out_dir)
"""

import json
import os
import shutil
from pathlib import Path
from types import TracebackType

import torch

COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
INDEX_FILE = "model.safetensors.index.json"


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2**30) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in shard for shard in self._shards):
            raise ValueError(f"{name} was written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self._shards) + 1
        tmp = self.out / f".model-{index:05d}.safetensors.tmp"
        save_file(self._pending, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.out / f"model-{index:05d}.safetensors")
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> None:
        """Write the last shard, name every shard `model-i-of-n.safetensors` and write the index."""
        if self._pending:
            self._flush()
        total = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.replace(self.out / f"model-{i:05d}.safetensors", self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = self.out / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, self.out / INDEX_FILE)

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()


def copy_model_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the config, generation config and tokenizer files that `src_dir` has; returns their names."""
    src = Path(src_dir)
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, Path(out_dir) / name)
            copied.append(name)
    return copied
