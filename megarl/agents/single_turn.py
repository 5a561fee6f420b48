"""The single-turn agent loop: one generation of up to the response budget."""

import time

from megarl.agents.base import AgentLoop, AgentOutput, AgentSample, RoutedExperts
from megarl.engines.client.sampling import SamplingParams


class SingleTurnAgentLoop(AgentLoop):
    """One generation of up to the response budget."""

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        started = time.perf_counter()
        routed = RoutedExperts()
        response_length = self.context.response_length
        result = await self.model_turn(sample, sample.prompt_ids, sampling, response_length, turn=0, routed=routed)
        ids = list(result.output_ids)
        text = self.context.chat.decode_reply(ids)
        return AgentOutput(
            prompt_ids=list(sample.prompt_ids),
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=list(result.output_logprobs or [0.0] * len(ids)),
            response_versions=result.token_versions(),
            finish_reason=result.finish_reason.type,
            metrics={"gen_seconds": time.perf_counter() - started, "num_resubmits": float(result.num_resumes)},
            messages=[*sample.messages, {"role": "assistant", "content": text}],
            routed_experts=routed.joined(),
        )
