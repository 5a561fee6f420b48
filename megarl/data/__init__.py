"""RL and SFT data: GSM8K preprocessing, the prompt dataset, the chat SFT dataset and a resumable loader."""

from megarl.data.dataset import RLDataset, collate_prompts, load_tool_schemas
from megarl.data.loader import StatefulDataLoader
from megarl.data.sft import SFTDataset, collate_sft, tokenize_conversation

__all__ = [
    "RLDataset",
    "SFTDataset",
    "StatefulDataLoader",
    "collate_prompts",
    "collate_sft",
    "load_tool_schemas",
    "tokenize_conversation",
]
