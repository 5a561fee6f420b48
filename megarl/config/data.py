"""Data: parquet files of prompts, prompt/response lengths and the prompts per step."""

from dataclasses import dataclass, field
from typing import Any

TRUNCATIONS = ("error", "left", "right", "middle")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files of training prompts (megarl-preprocess writes them)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files of validation prompts; empty = no validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages of each prompt."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template; longer prompts are filtered or truncated."""
    max_response_length: int = 512
    """Response tokens per trajectory (all turns of a multi-turn one)."""
    train_batch_size: int = 64
    """Prompts per training step; each yields rollout.n trajectories."""
    val_batch_size: int | None = None
    """Prompts per validation batch; None = the whole validation set at once."""
    truncation: str = "error"
    """Prompts over max_prompt_length when not filtered: error | left | right | middle."""
    filter_overlong_prompts: bool = True
    """Drop prompts over max_prompt_length when the dataset is loaded."""
    shuffle: bool = True
    """Shuffle training prompts each epoch."""
    seed: int = 1
    """Seed of the training-data order."""
    max_train_samples: int | None = None
    """Use only the first N training rows; None = all."""
    max_val_samples: int | None = None
    """Use only the first N validation rows; None = all."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the tokenizer's apply_chat_template."""
