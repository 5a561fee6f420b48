"""Token generation: the SGLang protocol client, engine launchers, the embedded engine, the router.

Nothing here imports Megatron: the rollout side talks to the trainer only through weights.
"""
