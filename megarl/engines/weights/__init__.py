"""Weights into engines: named tensors passed by handle (`tensor_handles`) and the broadcast group between a
trainer sender and engine ranks (`weight_group`)."""
