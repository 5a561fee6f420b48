"""Rollout engines and how to reach them: the SGLang protocol and client, the router, SGLang command
lines, replica launch on Ray, the embedded engine, tensor handles and the weight-update group.

Nothing here imports Megatron or `megarl.agents`: agents drive engines through the router and
client, the trainer reaches them only through weights (`megarl.sync`).
"""
