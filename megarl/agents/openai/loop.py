"""`agent_loop=openai`: run a user's agent, written only against the `openai` client, as one sample's rollout.

    async def run(client: openai.AsyncOpenAI, sample: dict) -> float | dict | None

`client` is bound to the sample's session on this worker's `SessionServer` (`base_url` …/sessions/<id>/v1); every
chat completion it sends is a model turn of the trajectory, recorded token for token (`session.py`). `sample`
holds `messages` (the prompt), `tools` (the schemas of the tools the row names, if any), `ground_truth`,
`data_source`, `extra_info`, `sample_id` and `base_url` (for an agent that runs its own process or harness).

The return is the reward: a number, or a dict with `score` (the reward) and other numeric components (reward
extras, e.g. for GDPO); None leaves the row to the reward function. With `reward.function` set, that function
scores every row and the agent's return is only logged (`openai/agent_reward`). A sample is bounded by
agents.openai.timeout_s and max_turns; an agent that raises or times out ends only its sample: its tokens so far are
the row, its reward 0 unless a reward function is set, and `finish_reason` says why (`agent_error`,
`agent_timeout`, or the server's `length` / `max_turns` / `history_rewrite` / `abort`).
"""

import asyncio
import logging
import time
from numbers import Real
from typing import Any

from megarl.agents.base import AgentContext, AgentLoop, AgentOutput, AgentSample
from megarl.agents.openai.server import Live, SessionServer
from megarl.agents.openai.session import Turn
from megarl.agents.openai.transport import in_process_client
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult
from megarl.plugins import import_callable

logger = logging.getLogger(__name__)


class OpenAIAgentLoop(AgentLoop):
    def __init__(self, context: AgentContext) -> None:
        super().__init__(context)
        import openai

        self.config = context.openai
        if not self.config.agent:
            raise ValueError("agent loop `openai` needs agents.openai.agent=package.module:function")
        self.agent = import_callable(self.config.agent)
        self.server = SessionServer(context, self.config, self._generate)
        self._openai = openai
        self._http: Any = None

    async def run(self, sample: AgentSample, sampling: SamplingParams) -> AgentOutput:
        base = await self.server.start()
        live = self.server.open(sample, sampling)
        url = f"{base}/sessions/{sample.sample_id}/v1"
        client = self._openai.AsyncOpenAI(
            base_url=url, api_key=sample.sample_id, max_retries=0, http_client=self._client()
        )
        started = time.perf_counter()
        try:
            outcome, value = await self._drive(client, self._sample_dict(sample, url))
        finally:
            self.server.release(sample.sample_id)
        return self._output(sample, live, outcome, value, time.perf_counter() - started)

    def _client(self) -> Any:
        """The HTTP client of every session's `AsyncOpenAI` (closed by `close`): straight into the server's handler
        under agents.openai.in_process, else one connection pool to its socket."""
        if self._http is None:
            timeout = self.config.timeout_s
            if self.config.in_process:
                self._http = in_process_client(self._openai, self.server, timeout)
            else:
                self._http = self._openai.DefaultAsyncHttpxClient(timeout=self._openai.Timeout(timeout))
        return self._http

    async def _drive(self, client: Any, sample: dict[str, Any]) -> tuple[str, Any]:
        """("ok", the agent's return) or ("agent_error" | "agent_timeout", None); never raises."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                return "ok", await self.agent(client, sample)
        except TimeoutError:
            return "agent_timeout", None
        except Exception as err:  # the user's agent may fail in any way; its sample ends, the batch goes on
            logger.info("agent %s failed on sample %s: %r", self.config.agent, sample["sample_id"], err)
            return "agent_error", None

    async def _generate(self, live: Live, turn: Turn, sampling: SamplingParams) -> GenerateResult:
        turn_number, routed = live.session.turns, turn.segment.routed
        return await self.model_turn(live.sample, turn.input_ids, sampling, turn.max_new_tokens, turn_number, routed)

    def _sample_dict(self, sample: AgentSample, url: str) -> dict[str, Any]:
        named = sample.tools_kwargs
        tools = [tool.tool_schema for name, tool in self.context.tools.items() if not named or name in named]
        return dict(sample.info) | {
            "messages": [dict(m) for m in sample.messages],
            "tools": tools or None,
            "sample_id": sample.sample_id,
            "base_url": url,
        }

    def _output(self, sample: AgentSample, live: Live, outcome: str, value: Any, seconds: float) -> AgentOutput:
        out = live.session.output(sample.prompt_ids)
        reward, extra, bad = _reward(value) if outcome == "ok" else (None, {}, False)
        if bad:
            outcome = "agent_error"
            logger.info(
                "agent %s returned %r for sample %s; want a number or a dict with `score`",
                self.config.agent,
                value,
                sample.sample_id,
            )
        out.finish_reason = self._finish_reason(outcome, live)
        out.metrics |= {
            "openai/agent_seconds": seconds,
            "openai/server_seconds": live.seconds["handler"] - live.seconds["engine"],
            "gen_seconds": live.seconds["engine"],
            "num_parse_errors": float(live.parse_errors),
            "openai/agent_errors": float(outcome == "agent_error"),
            "openai/agent_timeouts": float(outcome == "agent_timeout"),
        }
        if self.context.reward_function:
            if reward is not None:
                out.metrics["openai/agent_reward"] = reward
        elif outcome != "ok":
            out.reward = 0.0
        else:
            out.reward, out.reward_extra = reward, extra
        return out

    @staticmethod
    def _finish_reason(outcome: str, live: Live) -> str:
        """Why the server refused a request, else how the agent ended, else the engine's last finish."""
        return live.session.ended or (outcome if outcome != "ok" else live.session.last_finish)

    async def close(self) -> None:
        await self.server.close()
        if self._http is not None:
            await self._http.aclose()


def _reward(value: Any) -> tuple[float | None, dict[str, float], bool]:
    """(reward, extras, malformed) of an agent's return."""
    if value is None:
        return None, {}, False
    if isinstance(value, Real) and not isinstance(value, bool):
        return float(value), {}, False
    if isinstance(value, dict) and isinstance(value.get("score"), Real):
        extra = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, Real)}
        return float(value["score"]), extra, False
    return None, {}, True
