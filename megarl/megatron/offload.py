"""Move a role's parameters, gradient buffers and optimizer state to host memory and back.

Used while the colocated rollout engine holds the device. Each tensor's storage is copied to a
host tensor and then resized to zero bytes, so views into it (megatron's parameters live inside
DDP's contiguous buffers) stay valid and come back in place on reload. On a CPU-only machine the
"device" is host memory too; the storage accounting (`resident_bytes`) is the same.
"""

from collections.abc import Iterator

import torch

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
    optimizers = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    for opt in optimizers:
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _grad_buffers(trainable: Trainable) -> Iterator[torch.Tensor]:
    for chunk in trainable.chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            yield buffer.grad_data


def _params(owner: Trainable | BuiltModel) -> Iterator[torch.Tensor]:
    for chunk in owner.chunks:
        yield from (p.data for p in chunk.parameters())


class Offloader:
    """offload() frees the chosen device storages into host copies; reload() restores them in place.

    `owner` is a trainable role, or a bare model (a frozen reference: parameters only).
    """

    def __init__(
        self, owner: Trainable | BuiltModel, params: bool = True, grads: bool = True, optimizer: bool = True
    ) -> None:
        if not isinstance(owner, Trainable) and (grads or optimizer):
            raise ValueError("a model without an optimizer has only parameters to offload; pass grads/optimizer=False")
        self.owner = owner
        self.kinds = {"params": params, "grads": grads, "optimizer": optimizer}
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _tensors(self) -> list[torch.Tensor]:
        owner, kinds = self.owner, self.kinds
        tensors = list(_params(owner)) if kinds["params"] else []
        if isinstance(owner, Trainable):
            tensors += list(_grad_buffers(owner)) if kinds["grads"] else []
            tensors += list(_optimizer_state(owner)) if kinds["optimizer"] else []
        return _storages(iter(tensors))

    @torch.no_grad()
    def offload(self) -> int:
        """Returns the bytes freed on the device."""
        if self._host:
            return 0
        freed = 0
        for tensor in self._tensors():
            storage = tensor.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.untyped_storage().copy_(storage)
            freed += storage.nbytes()
            self._host.append((tensor, host))
            storage.resize_(0)
        return freed

    @torch.no_grad()
    def reload(self) -> None:
        for tensor, host in self._host:
            storage = tensor.untyped_storage()
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._host = []


def resident_bytes(trainable: Trainable) -> int:
    """Bytes held by the role's parameters, gradient buffers and optimizer state right now."""
    return sum(resident_bytes_by_kind(trainable).values())


def resident_bytes_by_kind(trainable: Trainable) -> dict[str, int]:
    """Bytes held right now by the parameters, the gradient buffers and the optimizer state (what megarl-plan
    estimates)."""
    sources = {"params": _params, "grads": _grad_buffers, "optimizer": _optimizer_state}
    return {
        kind: sum(t.untyped_storage().nbytes() for t in _storages(source(trainable)))
        for kind, source in sources.items()
    }
