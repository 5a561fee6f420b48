"""CUDA handles name their GPU by UUID, and the receiving side maps the UUID to its own index.
Skipped without a GPU."""

import base64
import io
import multiprocessing
import pickle
from typing import Any

import torch
from gpu_cases import needs_cuda

from megarl.engines.weights.tensor_handles import DEVICE_ARG, deserialize_named_tensors, serialize_named_tensors

pytestmark = needs_cuda


class _Recorder(pickle.Unpickler):
    """Records the arguments of each `rebuild_cuda_tensor` call instead of opening the handle."""

    calls: list[tuple[Any, ...]]

    def find_class(self, module: str, name: str) -> Any:
        if name == "rebuild_cuda_tensor":
            return lambda *args: self.calls.append(args)
        return super().find_class(module, name)


def _receive(entry: str, expected: list[float], out: Any) -> None:
    ((_, tensor),) = deserialize_named_tensors(entry)
    out.put((tensor.device.index, tensor.cpu().tolist() == expected))


def test_a_cuda_handle_carries_the_gpu_uuid_and_opens_in_another_process() -> None:
    tensor = torch.arange(8.0, device="cuda:0")
    entry = serialize_named_tensors([("w", tensor)])
    recorder = _Recorder(io.BytesIO(base64.b64decode(entry)))
    recorder.calls = []
    recorder.load()
    (args,) = recorder.calls
    assert args[DEVICE_ARG] == str(torch.cuda.get_device_properties(0).uuid)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_receive, args=(entry, tensor.cpu().tolist(), out))
    child.start()
    index, same = out.get(timeout=120)
    child.join(timeout=60)
    assert index == 0 and same
