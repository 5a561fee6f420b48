"""megarl: reinforcement-learning post-training for LLMs (megatron-core, Ray, SGLang)."""

__version__ = "0.1.0"
