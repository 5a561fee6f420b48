"""Scoring trajectories as they finish: rule functions in a process pool, reward models on their engines, remote
reward services — one asynchronous pipeline on each agent worker (`pipeline.RewardPipeline`)."""
