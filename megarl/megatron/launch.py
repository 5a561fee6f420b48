"""Run a function on N local processes joined in one process group (tests, benchmarks, CPU demos)."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.ports import free_port


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, backend: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        from megarl.megatron import cpu_compat

        cpu_compat.apply()
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(*args)` on every rank of a fresh `backend` world; returns each rank's result, in rank order.

    `fn` must be importable (a module-level function) and its result picklable by torch.save.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, backend, fn, args),
            nprocs=world_size,
            start_method="spawn",
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
