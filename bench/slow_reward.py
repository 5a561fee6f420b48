"""The slow reward of bench/reward_overlap.py: the GSM8K rule after a wait fixed by the response.

The wait is uniform in [0.5, 1.5] × `seconds`, seeded by the response text, so a response waits the same in every
mode and run; it stands for a sandboxed test run, a heavy checker or a slow verifier.
"""

import math
import random
import time
from typing import Any

from megarl.agents.base import AgentLoop, AgentOutput, AgentSample
from megarl.engines.client.sampling import SamplingParams
from megarl.rewards import RewardResult
from megarl.rewards.gsm8k import compute_score


def score(solution_str: str, ground_truth: str, extra_info: Any = None, seconds: float = 0.2) -> RewardResult:
    time.sleep(seconds * random.Random(solution_str).uniform(0.5, 1.5))
    return compute_score(solution_str, ground_truth, extra_info)


class VariedLengthLoop(AgentLoop):
    """One generation with a response budget drawn per sample: lognormal around a quarter of the budget (seeded by
    the sample), as RL responses vary from a few tokens to the limit; random-weight models would all run to it."""

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        budget = self.context.response_length
        draw = random.Random(sample.seed).lognormvariate(math.log(budget / 4), 0.8)
        ignore_eos = SamplingParams(**{**sampling.to_json(), "ignore_eos": True})
        result = await self.model_turn(sample, sample.prompt_ids, ignore_eos, max(1, min(budget, int(draw))), turn=0)
        ids = list(result.output_ids)
        return AgentOutput(
            prompt_ids=list(sample.prompt_ids),
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=list(result.output_logprobs or [0.0] * len(ids)),
            messages=[*sample.messages, {"role": "assistant", "content": self.context.chat.decode_reply(ids)}],
        )
