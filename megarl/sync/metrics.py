"""What one weight sync measured, and the extra memory a sender holds while it runs."""

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class SyncMetrics:
    bytes: int
    buckets: int
    tensors: int
    bytes_skipped: int
    """Bytes of unchanged tensors not sent (delta mode)."""
    tensors_skipped: int
    seconds: float
    peak_extra_bytes: int
    """Largest extra memory any sender held (buffers + gathered tensor; measured on CUDA)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)

    def as_dict(self, prefix: str = "sync/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in {**asdict(self), "gb_per_s": self.gb_per_s}.items()}


class Accounting:
    """Bytes a sender holds now, and the most it held."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes
