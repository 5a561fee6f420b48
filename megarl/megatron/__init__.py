"""megatron-core training engine: per-role groups, model build, log-probs, training step, offload."""
