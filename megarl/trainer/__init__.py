"""The trainer driver and its checkpoints."""
