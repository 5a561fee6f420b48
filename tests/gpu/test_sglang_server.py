"""A real SGLang server on one GPU: launch, wait for /health_generate, generate from token ids, stop.

Needs CUDA, sglang==0.5.23 and MEGARL_GPU_MODEL=<a small HF model directory>; skipped otherwise.
"""

import importlib.util
import json
import os
import urllib.request
from pathlib import Path

import pytest
import torch

from megarl.engines.replicas.server_process import ServerProcess
from megarl.engines.replicas.sglang_command import (
    SGLangServerArgs,
    health_url,
    replica_layout,
    replica_node_args,
    sglang_command,
)
from megarl.ports import free_ports

MODEL = os.environ.get("MEGARL_GPU_MODEL")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang (the gpu extra)"),
    pytest.mark.skipif(MODEL is None, reason="set MEGARL_GPU_MODEL to a small HF model directory"),
]


def test_sglang_server_generates_from_input_ids(tmp_path: Path) -> None:
    assert MODEL is not None
    port, dist_port = free_ports(2)
    base = SGLangServerArgs(model_path=MODEL, mem_fraction_static=0.5, disable_cuda_graph=True, context_length=512)
    (args,) = replica_node_args(base, replica_layout(1, 1, tp=1), 0, ["127.0.0.1"], port, dist_port)
    with ServerProcess(sglang_command(args), log_path=tmp_path / "sglang.log") as server:
        server.wait_healthy(health_url(args, "127.0.0.1"), timeout_s=600)
        body = {
            "input_ids": [1, 2, 3, 4, 5],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            result = json.loads(reply.read())
    output_ids = result["output_ids"]
    assert len(output_ids) == 8 and all(isinstance(t, int) for t in output_ids)
    assert result["meta_info"]["completion_tokens"] == 8
    assert result["meta_info"]["finish_reason"]["type"] == "length"
    assert not server.alive
