"""Weights into engines: named tensors passed by handle (`tensor_handles`), the broadcast group between a
trainer sender and engine ranks (`weight_group`), and LoRA adapters passed by handle (`adapters`)."""
