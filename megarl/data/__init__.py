"""RL data: GSM8K preprocessing, the prompt dataset and a resumable loader."""

from megarl.data.dataset import RLDataset, collate_prompts, load_tool_schemas
from megarl.data.loader import StatefulDataLoader

__all__ = ["RLDataset", "StatefulDataLoader", "collate_prompts", "load_tool_schemas"]
