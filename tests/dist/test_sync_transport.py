"""Where a broadcast sender says engines can reach it."""

from multiprocessing.reduction import ForkingPickler

import pytest
import ray
import torch
from torch.multiprocessing import reductions

from megarl.engines.replicas.sglang_command import LOOPBACK
from megarl.engines.weights.tensor_handles import deserialize_named_tensors, device_index, serialize_named_tensors
from megarl.sync.transport import EngineTarget, group_host


def test_local_engines_reach_the_sender_on_loopback() -> None:
    assert group_host([EngineTarget("http://127.0.0.1:30000"), EngineTarget("http://localhost:30001")]) == LOOPBACK


def test_remote_engines_get_a_routable_address_not_a_loopback_one() -> None:
    node_ip = str(ray.util.get_node_ip_address())  # this machine's routable address, as Ray reports it
    assert not node_ip.startswith("127.")
    host = group_host([EngineTarget("http://127.0.0.1:30000"), EngineTarget(f"http://{node_ip}:30000")])
    assert host == node_ip


def test_handles_by_gpu_uuid_leave_torchs_own_reductions_alone() -> None:
    """The UUID reduction lives in megarl's pickler only: a global patch would change every pickle."""
    tensor = torch.arange(4.0)
    ((name, back),) = deserialize_named_tensors(serialize_named_tensors([("w", tensor)]))
    assert name == "w" and torch.equal(back, tensor)
    assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor
    assert reductions.rebuild_cuda_tensor.__module__ == "torch.multiprocessing.reductions"
    assert device_index(3) == 3
    with pytest.raises(ValueError, match="no visible CUDA device has UUID GPU-0000"):
        device_index("GPU-0000")
