"""The resharding manager: Megatron TP/PP/EP shards → HF tensors → buckets → engine replicas.

planner (`plan`) → executor (`executor`, `transforms`) → transport (`transport`); `delta` skips
unchanged tensors, `sequence` orders memory hand-over when colocated, `build` reads the config.
"""
