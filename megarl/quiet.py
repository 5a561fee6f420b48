"""Silence the libraries' start-up notices and progress bars that say nothing a user can act on.

On CPU every megatron-core process warns that Transformer Engine and Apex are missing and that it falls
back to torch (expected: megarl uses the local spec there), megatron-core 0.16.1 warns about its own
deprecated defaults, and torch about gloo collectives megatron-core still calls. Each Ray worker
repeats them, so they (and `datasets`' progress bars for a 2,048-row parquet file) buried the per-step
lines of the CPU demo. Imported by `megarl/__init__.py`, so
every megarl process (driver, Ray workers, engines) installs the filters before megatron-core is
imported. Only these messages are dropped; any other warning still shows.
"""

import logging
import os
import warnings

NOT_ACTIONABLE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"When using async grad allreduce",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base|_reduce_scatter_base)`",
)


def install() -> None:
    """Filter the `NOT_ACTIONABLE` warnings and megatron-core's INFO start-up logs (idempotent)."""
    for message in NOT_ACTIONABLE:
        warnings.filterwarnings("ignore", message=f".*{message}")
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when `datasets` is imported
