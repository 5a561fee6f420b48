"""The rule component: a row's reward function (by data_source, or `reward.function`) run off the event loop.

With `reward.num_workers` > 0 the function runs in that many processes of its own (spawned, so nothing of the
agent worker's threads is inherited), and a slow or CPU-bound reward cannot stall the worker's event loop; with 0
it runs in a thread (cheap functions, tests). A row its agent loop scored (a tool or an interaction) takes that
reward instead, without a call.
"""

import asyncio
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

from megarl.config.trainer import RewardConfig
from megarl.rewards import RewardResult, get_reward_fn
from megarl.rewards.sources import Trajectory


def run_rule(source: str, function: str | None, response: str, truth: str, extra: Any, kwargs: dict) -> RewardResult:
    """The reward function of `source` (or `function`) on one response (what the pool's processes run)."""
    return get_reward_fn(source, function)(response, truth, extra, **kwargs)


class RuleScorer:
    """Calls reward functions on `reward.num_workers` processes (0: a thread); `close()` waits for running calls."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._pool: Executor | None = None

    def _executor(self) -> Executor | None:
        if self.cfg.num_workers > 0 and self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.cfg.num_workers, mp_context=context)
        return self._pool

    async def score(
        self, trajectory: Trajectory, loop_reward: float | None, loop_extra: dict[str, float] | None = None
    ) -> RewardResult:
        """The agent loop's reward (and its components) when it has one, else the reward function's result on the
        response text."""
        if loop_reward is not None:
            return RewardResult(float(loop_reward), extra=dict(loop_extra or {}))
        t = trajectory
        args = (t.data_source, self.cfg.function, t.response_text, t.ground_truth, t.extra_info, self.cfg.kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor(), run_rule, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
