"""What every test under tests/gpu/ shares: where it runs, and where it reports its numbers.

Each test needs a CUDA GPU and is skipped without one, except under `tests/gpu/device_check.sh --dry`
(`MEGARL_DEVICE_CHECK=dry`): there the tests that have a CPU form rehearse on host memory over gloo, so that
their code is known to run before a GPU is lent. `needs_cuda` marks what exists only on a GPU (CUDA IPC
handles, the caching allocator's memory). `record` appends a test's numbers (parity gaps, memory) to
`$MEGARL_CHECK_REPORT` as JSON lines when the check sets it; the check's summary lists them.
"""

import json
import os
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
DRY = os.environ.get("MEGARL_DEVICE_CHECK") == "dry"
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "nccl" if CUDA else "gloo"
needs_device = pytest.mark.skipif(not (CUDA or DRY), reason="needs a CUDA GPU (or device_check.sh --dry)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def record(test: str, **numbers: Any) -> None:
    path = os.environ.get("MEGARL_CHECK_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": test, "device": DEVICE, **numbers}) + "\n")
