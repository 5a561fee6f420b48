"""Agents turn prompts into trajectories: the `RolloutManager`, Ray agent workers, agent loops
(single-turn, the tool state machine), chat-template deltas, tool-call parsers, tools, interactions
and post-processing to a padded `Batch`. They reach engines only through `megarl.engines.client` (its router).
"""
