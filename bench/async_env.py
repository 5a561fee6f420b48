"""The agent loop of bench/async.py: one generation, then an environment step with a long-tail latency.

Agentic RL waits on tools, sandboxes and simulated users whose latency has a long tail; a synchronous
step then waits for its slowest trajectory while the devices idle. The wait here is lognormal
(median `MEDIAN_S`, log-sd `SIGMA`, capped at `CAP_S`) and seeded by the sample, so a trajectory
waits the same in every run and every mode. The trajectory holds no engine resources while waiting.

    rollout.default_agent=async_env:SlowEnvAgentLoop   (with bench/ on PYTHONPATH)
"""

import asyncio
import math
import random

from megarl.agents.base import AgentOutput, AgentSample
from megarl.agents.single_turn import SingleTurnAgentLoop
from megarl.engines.client.sampling import SamplingParams

MEDIAN_S = 0.25
SIGMA = 1.2
CAP_S = 6.0


def env_seconds(seed: int | None) -> float:
    """The environment's latency for the sample seeded `seed` (unseeded: a fresh draw)."""
    return min(CAP_S, random.Random(seed).lognormvariate(math.log(MEDIAN_S), SIGMA))


class SlowEnvAgentLoop(SingleTurnAgentLoop):
    """`single_turn`, then `env_seconds(sample.seed)` of waiting (reported as `env_seconds`)."""

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        out = await super().run(sample, sampling)
        seconds = env_seconds(sample.seed)
        await asyncio.sleep(seconds)
        out.metrics["env_seconds"] = seconds
        return out
