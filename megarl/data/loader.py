"""A data loader whose position (epoch, batches consumed) is saved and restored with checkpoints.

The order of epoch e is a permutation drawn from `torch.Generator().manual_seed(seed + e)`, so a
resumed loader yields exactly the batches an uninterrupted one would have::

    loader = StatefulDataLoader(dataset, batch_size=8, seed=1, collate_fn=collate)
    for batch in loader:          # one epoch, from the saved position on
        ...
        state = loader.state_dict()   # {"epoch": 0, "batches_consumed": 3, ...}
    loader.load_state_dict(state)
"""

from collections.abc import Callable, Iterator, Sized
from typing import Any, Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class MapDataset(Sized, Protocol):
    def __getitem__(self, index: int) -> Any: ...


class StatefulDataLoader(Generic[T]):
    """Batches of a map-style dataset; iterating runs the rest of the current epoch."""

    def __init__(
        self,
        dataset: MapDataset,
        batch_size: int,
        collate_fn: Callable[[list[Any]], T],
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one batch of {batch_size}: "
                "lower data.train_batch_size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_consumed = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices of `epoch` in the order they are served."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[T]:
        order = self.epoch_order(self.epoch)
        while self.batches_consumed < len(self):
            start = self.batches_consumed * self.batch_size
            rows = [self.dataset[i] for i in order[start : start + self.batch_size]]
            self.batches_consumed += 1
            yield self.collate_fn(rows)
        self.epoch += 1
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, int]:
        """The position: the next batch served is batch `batches_consumed` of `epoch`."""
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; the seed must match the one the position was taken with."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']} but this loader uses {self.seed}; "
                "resume with the same data.seed"
            )
        if not 0 <= state["batches_consumed"] <= len(self):
            raise ValueError(f"loader state batches_consumed={state['batches_consumed']} is outside 0..{len(self)}")
        self.epoch = state["epoch"]
        self.batches_consumed = state["batches_consumed"]
