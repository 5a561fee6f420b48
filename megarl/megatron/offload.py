"""Move a role's parameters, gradient buffers and optimizer state off the device and back.

Used while the colocated rollout engine holds the device. Parameters and optimizer state (the moments and,
for bf16/fp16 parameters, the fp32 master weights) have each storage copied to a host tensor and then resized
to zero bytes, so views into it (megatron's parameters live inside DDP's contiguous buffers) stay valid and
come back in place on reload. Gradient buffers are only freed: every training step zeroes them before its
first backward (`MegatronEngine.train_step`), so their contents are never worth a copy. On a CPU-only machine
the "device" is host memory too; the storage accounting (`resident_bytes`) is the same.

A freed block stays reserved by this process's CUDA caching allocator until `free_cached_memory()` hands it
back to the device; every offload ends with it, so the colocated engine can allocate what the trainer left.
"""

import gc
from collections.abc import Iterator

import torch
from megatron.core.distributed import DistributedDataParallel

from megarl.megatron.model import BuiltModel
from megarl.megatron.optim import Trainable


def _storages(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if tensor.untyped_storage().nbytes() and key not in seen:
            seen.add(key)
            out.append(tensor)
    return out


def _optimizer_state(trainable: Trainable) -> Iterator[torch.Tensor]:
    """Each optimizer's per-parameter state, and the fp32 master weights it steps for bf16/fp16 parameters."""
    optimizers = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    for opt in optimizers:
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        yield from _master_weights(opt)


def _master_weights(opt: object) -> Iterator[torch.Tensor]:
    """The fp32 copies of bf16/fp16 parameters: the distributed optimizer's shards
    (distrib_optimizer.py `shard_fp32_from_float16_groups`), else Float16OptimizerWithFloat16Params' whole
    copies (optimizer.py `fp32_from_float16_groups`). An fp32 parameter is its own master (a view of the
    parameter, which the params kind covers). megatron's own `MegatronOptimizer.offload_to_cpu` replaces each
    `param_groups` tensor's `.data` by a CPU copy: on a distributed optimizer with fp32 parameters those are views
    of DDP's parameter buffer, which `restore_from_cpu` would bring back as separate tensors."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
    for group in groups:
        yield from (main for main in group if main is not None)


def _grad_buffers(trainable: Trainable) -> Iterator[torch.Tensor]:
    for chunk in trainable.chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            yield buffer.grad_data


def _params(owner: Trainable | BuiltModel) -> Iterator[torch.Tensor]:
    for chunk in owner.chunks:
        yield from (p.data for p in chunk.parameters())


def free_cached_memory() -> None:
    """Hand the device blocks this process no longer uses back to the driver, for a colocated engine to allocate
    (slime utils/memory_utils.py `clear_memory`). A storage resized to zero or a tensor dropped only returns its
    block to torch's caching allocator, which keeps it reserved: SGLang's `resume_memory_occupation` would find
    no physical memory. `gc.collect()` first drops tensors that only reference cycles keep; `ipc_collect` frees
    bucket buffers that an engine mapped by CUDA IPC and has let go of since (torch keeps them in a limbo,
    torch/csrc/CudaIPCTypes.cpp)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


def freeze_startup_objects() -> None:
    """Once a role is built: collect, then move every object alive (modules, the model, megatron's state) out of
    reach of later collections, so each offload's `gc.collect()` walks only what training made since. SGLang
    does the same after its warm-up (utils/common.py `freeze_gc`), as does the embedded engine
    (`engines/embedded/weights.py::freeze_startup_objects`); unfrozen, a collection in a trainer rank took
    ~0.3 s of a 3 s CPU demo step, twice a step."""
    gc.collect()
    gc.freeze()


def reserved_bytes() -> int:
    """Device memory this process's CUDA caching allocator reserves now (0 without CUDA)."""
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def handover_memory(before: int) -> dict[str, float]:
    """`handover/reserved_{before,after}_bytes`: what the caching allocator reserved before a hand-over (`before`,
    from `reserved_bytes()`) and reserves now, after it."""
    return {"handover/reserved_before_bytes": float(before), "handover/reserved_after_bytes": float(reserved_bytes())}


class Offloader:
    """offload() frees the chosen device storages (parameters and optimizer state into host copies, gradient
    buffers without one); reload() restores them in place (gradient buffers zeroed).

    `owner` is a trainable role, or a bare model (a frozen reference: parameters only).
    """

    def __init__(
        self, owner: Trainable | BuiltModel, params: bool = True, grads: bool = True, optimizer: bool = True
    ) -> None:
        if not isinstance(owner, Trainable) and (grads or optimizer):
            raise ValueError("a model without an optimizer has only parameters to offload; pass grads/optimizer=False")
        self.owner = owner
        self.kinds = {"params": params, "grads": grads, "optimizer": optimizer}
        self.offloaded = False
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held now."""
        return sum(host.numel() for _, host in self._host)

    def _copied(self) -> list[torch.Tensor]:
        """The storages that go to host copies: parameters and optimizer state."""
        owner, kinds = self.owner, self.kinds
        tensors = list(_params(owner)) if kinds["params"] else []
        if isinstance(owner, Trainable) and kinds["optimizer"]:
            tensors += list(_optimizer_state(owner))
        return _storages(iter(tensors))

    def _grad_chunks(self) -> list[DistributedDataParallel]:
        """The DDP chunks whose gradient buffers this offloader frees."""
        return self.owner.chunks if isinstance(self.owner, Trainable) and self.kinds["grads"] else []

    def _free_grads(self) -> int:
        """Free the gradient buffers without a copy (distributed_data_parallel.py `offload_grad_buffers`: each
        buffer's storage resized to zero); the bytes freed."""
        chunks = self._grad_chunks()
        buffers = [buffer.grad_data for chunk in chunks for buffer in chunk.buffers + chunk.expert_parallel_buffers]
        freed = sum(t.untyped_storage().nbytes() for t in _storages(iter(buffers)))
        for chunk in chunks:
            chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
        return freed

    @torch.no_grad()
    def offload(self) -> int:
        """Frees the storages and hands their memory back to the device (`free_cached_memory`); returns the bytes
        freed (0 when already offloaded)."""
        if self.offloaded:
            return 0
        freed = self._free_grads()
        for tensor in self._copied():
            storage = tensor.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.untyped_storage().copy_(storage)
            freed += storage.nbytes()
            self._host.append((tensor, host))
            storage.resize_(0)
        self.offloaded = True
        free_cached_memory()
        return freed

    @torch.no_grad()
    def reload(self) -> None:
        """Everything back in place (a no-op unless offloaded); gradient buffers at their size again, zeroed
        (`restore_grad_buffers`)."""
        if not self.offloaded:
            return
        for tensor, host in self._host:
            storage = tensor.untyped_storage()
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        for chunk in self._grad_chunks():
            chunk.restore_grad_buffers(synchronize=False)
        self._host = []
        self.offloaded = False


def resident_bytes(trainable: Trainable) -> int:
    """Bytes held by the role's parameters, gradient buffers and optimizer state right now."""
    return sum(resident_bytes_by_kind(trainable).values())


def resident_bytes_by_kind(trainable: Trainable) -> dict[str, int]:
    """Bytes held right now by the parameters, the gradient buffers and the optimizer state (its moments and
    fp32 master weights: what megarl-plan estimates)."""
    sources = {"params": _params, "grads": _grad_buffers, "optimizer": _optimizer_state}
    return {
        kind: sum(t.untyped_storage().nbytes() for t in _storages(source(trainable)))
        for kind, source in sources.items()
    }
