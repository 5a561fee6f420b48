"""Rollout: the generation engine, its replicas and sampling."""

from dataclasses import dataclass, field
from typing import Any

ENGINES = ("embedded", "sglang")


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    n: int = 1
    """Samples per prompt."""


@dataclass(kw_only=True, slots=True)
class MultiTurnConfig:
    tool_config_path: str | None = None
    """YAML listing tools (`tools: [{class_name, config, tool_schema}]`); schemas go into the chat template."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "embedded"
    """embedded (transformers + torch server speaking SGLang's protocol; CPU or one GPU) | sglang."""
    n: int = 1
    """Samples per prompt during training (the GRPO group size)."""
    temperature: float = 1.0
    """Training-time sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Training-time nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Training-time top-k; -1 = all."""
    tensor_parallel_size: int = 1
    """Devices per rollout replica (SGLang --tp-size); replicas = rollout devices ÷ this."""
    mem_fraction_static: float = 0.6
    """SGLang --mem-fraction-static: device memory share for weights + KV cache."""
    enable_memory_saver: bool = True
    """Release weights and KV cache while the trainer holds the device (colocated)."""
    default_agent: str = "single_turn"
    """Agent loop for rows without an `agent_name`."""
    val: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Sampling during validation (greedy by default)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool-using agent loops."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra engine arguments passed through unchanged (e.g. SGLang's attention_backend)."""
