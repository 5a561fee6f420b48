"""Rollout replicas started and kept alive: SGLang command lines and replica layout, server processes on Ray
node actors, placement, `launch_engines` from the config, the supervisor that restarts them."""
