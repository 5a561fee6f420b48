"""LoRA `adapter` sync: each weight version's adapter, not the model, goes to the engines.

    syncer.sync("v3")   # every rank of the actor: the adapter gathered on rank 0 (megabytes), loaded into every
                        # replica as `megarl-lora-v3` (`/load_lora_adapter_from_tensors`), the version set

The base weights move only when the engines need them: on the first sync (an engine may hold other weights, e.g.
the trainer's random init differs from model.path) and with `full` (a restarted engine; colocated engines that
drop their weights while asleep, `rollout.enable_weights_cpu_backup=false`). The rollout side then names the new
adapter in its requests (`Router.use_adapter`, told by the driver: `megarl.trainer.handover`) and unloads the old
one once its requests have ended.
"""

import time

import torch
import torch.distributed as dist

from megarl.config.lora import LoraConfig, adapter_name
from megarl.engines.weights.adapters import load_adapter
from megarl.lora.peft_io import adapter_config, gather_adapter, short_names
from megarl.sync.executor import WeightSyncer
from megarl.sync.metrics import SyncMetrics


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterSyncer(WeightSyncer):
    """A `WeightSyncer` (its base-weight sync unchanged) whose `sync` sends the LoRA adapter."""

    def configure_adapter(self, lora: LoraConfig, ranks_per_engine: int) -> None:
        """`lora`: the actor's adapters (rank, alpha: PEFT's config); `ranks_per_engine`: SGLang's TP size (one
        tensor payload per engine rank)."""
        self.lora = lora
        self.ranks_per_engine = ranks_per_engine
        self.base_sent = False

    def sync(self, weight_version: str | None = None, full: bool = False) -> SyncMetrics:
        """Base weights if the engines need them, then the adapter of `weight_version`; global metrics (rank 0)."""
        start = time.perf_counter()
        base = super().sync(weight_version, full=True) if full or not self.base_sent else None
        self.base_sent = True
        tensors = gather_adapter(self.model, self.groups, self.engine_dtype)  # {} off rank 0
        named = sorted(tensors.items())
        config = adapter_config(self.lora, short_names(tensors))
        name = adapter_name(weight_version)
        ranks = self.ranks_per_engine
        self.call_engines("load_lora_adapter_from_tensors", lambda f: load_adapter(f, name, config, named, ranks))
        if base is None and weight_version is not None:
            self.call_engines("update_weight_version", lambda f: f.set_version(weight_version))
        sent = torch.tensor([_nbytes(tensors), len(tensors)], dtype=torch.int64)
        dist.all_reduce(sent, group=self._control)
        plan, _ = self.plan()
        return SyncMetrics(
            bytes=int(sent[0].item()) + (base.bytes if base else 0),
            buckets=1 + (base.buckets if base else 0),
            tensors=int(sent[1].item()) + (base.tensors if base else 0),
            bytes_skipped=0 if base else plan.total_bytes,
            tensors_skipped=0 if base else len(plan.tensors),
            seconds=time.perf_counter() - start,
            peak_extra_bytes=base.peak_extra_bytes if base else 0,
        )
