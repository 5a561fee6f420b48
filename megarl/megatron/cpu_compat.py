"""Run megatron-core on a CUDA-less machine over gloo.

megatron-core hard-codes CUDA in a handful of places. `apply()` redirects each of them to the
CPU, once per process, and only when CUDA is absent: on a GPU machine it returns without
touching anything. Every redirect names the megatron call site it serves. The layer was written
against one megatron-core version and refuses any other, because the call sites move between
releases.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON_CORE = "0.16.1"

_state = {"applied": False}


def is_applied() -> bool:
    """Whether the CPU redirects are active in this process."""
    return _state["applied"]


def check_megatron_version(installed: str) -> None:
    """Raise if `installed` is not the megatron-core release this layer was written for."""
    if installed != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megarl's CPU compatibility layer was written for megatron-core=={SUPPORTED_MEGATRON_CORE}, "
            f"but {installed} is installed. Install the pinned version (pip install "
            f"megatron-core=={SUPPORTED_MEGATRON_CORE}) or run on a CUDA machine."
        )


def apply() -> bool:
    """Apply the redirects if CUDA is absent. Returns whether they are active."""
    if torch.cuda.is_available():
        return False
    if _state["applied"]:
        return True
    check_megatron_version(metadata.version("megatron-core"))
    _redirect_devices()
    _redirect_rng()
    _redirect_streams()
    _split_sizes_as_numpy()
    _accept_cpu_params_in_optimizers()
    _define_missing_te_gemm()
    _state["applied"] = True
    return True


def _is_cuda(device: object) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` (or a CUDA ordinal) in tensor factories and `.to()` to the CPU.

    Serves the literal CUDA tensors in pipeline_parallel/schedules.py (`total_num_tokens`),
    optimizer/clip_grads.py and optimizer/optimizer.py (`found_inf`, norms), and
    `.to(device=torch.cuda.current_device())` in rotary_pos_embedding.py; drops `pin_memory=True` (no allocator
    for it without an accelerator: rope_utils.py `get_pos_emb_on_this_cp_rank`, which MLA's YaRN rotary cache
    calls under context parallelism).
    """

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _redirect_devices() -> None:
    # rotary_pos_embedding.py, tensor_parallel/layers.py: `torch.cuda.current_device()` as a device.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    # distributed/param_and_grad_buffer.py, tensor_parallel/data.py: `tensor.cuda()`.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    # optimizer/clip_grads.py, pipeline_parallel/schedules.py: `torch.cuda.synchronize()` guards.
    torch.cuda.synchronize = lambda device=None: None
    mode = _CudaToCpu()
    mode.__enter__()


def _redirect_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # tensor_parallel/random.py model_parallel_cuda_manual_seed / CudaRNGStatesTracker.add:
    # `torch.cuda.manual_seed` + `torch.cuda.get_rng_state` → the CPU generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    # CudaRNGStatesTracker.fork and checkpointing: `_get_cuda_rng_state` / `_set_cuda_rng_state`.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


class _NoStream:
    """Stand-in for torch.cuda.Stream / Event: everything already runs in program order on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> "_NoStream":
        return self

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _no_stream_context(stream: object = None) -> Iterator[None]:
    yield


def _redirect_streams() -> None:
    # transformer/moe/token_dispatcher.py (alltoall `cuda_dtoh_stream`), moe/shared_experts.py
    # (overlap stream), moe_utils.py (`record_stream(torch.cuda.current_stream())`).
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _NoStream()  # type: ignore[assignment,return-value]
    torch.cuda.stream = _no_stream_context  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, s: None  # type: ignore[method-assign]


def _split_sizes_as_numpy() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize asks
    # `maybe_move_tensor_to_cpu(splits, as_numpy=True)` for the split sizes of its all_to_all_single (and, under
    # expert TP, of its uneven all_gather). moe_utils.py converts only CUDA tensors, so CPU ones stay tensors and
    # torch.distributed.all_to_all_single raises `TypeError: all_to_all_single(): incompatible function arguments`.
    # The dispatcher imported the function by name.
    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original(tensor, as_numpy, record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


def _accept_cpu_params_in_optimizers() -> None:
    from megatron.core.optimizer import distrib_optimizer

    # optimizer/distrib_optimizer.py _build_model_and_main_param_groups and __init__ compare
    # `param.type()` with 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor' and raise
    # `TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...` for CPU ones.
    # While the optimizer is built (both run inside __init__), CPU tensors report their CUDA type name.
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    # optimizer/clip_grads.py clip_grad_by_total_norm_fp32: `assert param.grad.type() ==
    # 'torch.cuda.FloatTensor'` before scaling; optimizer.py imported the function by name.
    from megatron.core.optimizer import clip_grads, optimizer

    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip


def _with_cuda_type_names(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.type

        def cuda_type(self: torch.Tensor, *type_args: Any, **type_kwargs: Any) -> Any:
            if type_args or type_kwargs:
                return original(self, *type_args, **type_kwargs)
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = cuda_type  # type: ignore[method-assign,assignment]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.type = original  # type: ignore[method-assign]

    return wrapped


def _define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    # transformer/moe/moe_utils.py router gating: `te_general_gemm is not None` raises
    # `NameError: name 'te_general_gemm' is not defined` when TransformerEngine is absent.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
