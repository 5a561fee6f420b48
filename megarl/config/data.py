"""Data: parquet files of prompts, prompt/response lengths and the prompts per step."""

from dataclasses import dataclass, field
from typing import Any

TRUNCATIONS = ("error", "left", "right", "middle")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    # Any, not list[str]: OmegaConf would refuse a single path, which becomes a one-element list below.
    train_files: Any = field(default_factory=list)
    """Parquet files of training prompts (megarl-preprocess writes them); one path or a list."""
    val_files: Any = field(default_factory=list)
    """Parquet files of validation prompts, one path or a list; empty = no validation."""
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

    def __post_init__(self) -> None:
        # entries that are not paths are reported by `validate` (megarl.data.checks)
        self.train_files = _as_list(self.train_files)
        self.val_files = _as_list(self.val_files)


def _as_list(files: Any) -> Any:
    """A single path as a one-element list, null as an empty one; anything else as given."""
    if files is None:
        return []
    return [files] if isinstance(files, str) else files
