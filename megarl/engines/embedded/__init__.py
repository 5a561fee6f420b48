"""The embedded engine: a transformers + torch server that speaks SGLang's HTTP protocol.

For CPU development and CI, and for GPUs where SGLang is not installed. Run it with
`python -m megarl.engines.embedded --model-path DIR --port N`. It batches concurrent requests
(continuous batching over a padded KV cache), samples with per-request seeds, returns exact
log-probs, sleeps and wakes, and takes weights by handle or by a broadcast group.
"""
