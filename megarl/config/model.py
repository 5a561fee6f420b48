"""Model: which Hugging Face architecture to train and serve, and where its files are."""

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str
    """Hugging Face model directory: config.json (required), *.safetensors weights, tokenizer files."""
    tokenizer_path: str | None = None
    """Tokenizer directory (tokenizer.json + chat template); None = `path`."""
    random_init: bool = False
    """Initialise weights randomly instead of loading safetensors from `path` (the shipped tiny models)."""
    max_model_len: int | None = None
    """Longest prompt+response the model may see; None = `max_position_embeddings` of config.json."""
    dtype: str = "bfloat16"
    """Parameter dtype for training and rollout: float32 | bfloat16 | float16 (use float32 on CPU)."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the model directory."""
    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision tower's weights fixed while the language model trains."""
    train_projector: bool = False
    """Vision-language models: train the patch merger (the projector into the language model) even when the rest
    of the tower is frozen."""
