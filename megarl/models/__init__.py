"""The HF ⇄ megatron-core bridge: model specs, Megatron configs and the weight plan."""
