"""megarl: reinforcement-learning post-training for LLMs (megatron-core, Ray, SGLang)."""

from megarl import quiet

quiet.install()

__version__ = "0.1.0"
