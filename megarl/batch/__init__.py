"""`Batch` (batch.py) and its column helpers (columns.py): the one type in which data moves."""

from megarl.batch.batch import Batch
from megarl.batch.columns import MULTI_MODAL_COLUMN, NO_RECORD, ROUTING_COLUMN, routing_dtype

__all__ = ["MULTI_MODAL_COLUMN", "NO_RECORD", "ROUTING_COLUMN", "Batch", "routing_dtype"]
