"""Sampling parameters in SGLang's field names (srt/sampling/sampling_params.py::SamplingParams)."""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    """Tokens to generate at most; the context length may cap it further."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-6 = greedy. Returned log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    stop_token_ids: list[int] | None = None
    """Extra ids that end generation (besides the model's EOS)."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens: EOS and stop_token_ids do not stop (as in SGLang)."""
    n: int = 1
    """Samples per prompt; results come back prompt-major."""
    sampling_seed: int | None = None
    """Seed of this request's sampling (SGLang honours it with --enable-deterministic-inference)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other SGLang sampling fields passed through (e.g. min_p, repetition_penalty)."""

    def to_json(self) -> dict[str, Any]:
        """The request's `sampling_params` object: None fields are left to the engine's defaults."""
        body = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        return body | self.extra
