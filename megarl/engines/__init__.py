"""Rollout engines and how to reach them, one subpackage per responsibility:

- `client`: talking to running engines over HTTP. SGLang 0.5.23's API schema (`sglang_api`), sampling
  parameters, bearer keys, one replica's async client, the `Fleet` of clients for all-engines calls, the
  router over clients, an event loop on its own thread. Agents import from `megarl.engines` only this.
- `replicas`: starting and keeping replicas. SGLang command lines and replica layout, server processes,
  Ray node actors, placement, `launch_engines` and the supervisor that restarts lost replicas.
- `weights`: moving weights into engines. Tensor handles and the weight-update broadcast group.
- `embedded`: the embedded engine, a transformers + torch server speaking SGLang's HTTP API.

`client` imports no other subpackage; `weights` only `client`; `embedded` `client` and `weights`. Nothing here
imports Megatron or `megarl.agents`: the trainer reaches engines only through weights (`megarl.sync`).
"""
