"""Checkpoint formats: HF ⇄ megatron torch_dist conversion, streamed; the verifier."""
