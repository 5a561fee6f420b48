"""The distillation teacher on engines (`algorithm.distillation.teacher.backend=engine`): each finished trajectory's
tokens prefilled on the teacher's replicas, which return the log-prob of every response token (SGLang's input
log-probs: `megarl.engines.client.prefill_api`).

    teacher = TeacherScorer(TeacherEngines(urls=..., keys=..., retry=..., concurrency=32))
    log_probs = await teacher.log_probs(prompt_ids, response_ids)   # on the agent worker's loop, as a loop ends
    await teacher.close()

Consumes one trajectory's prompt and response ids per call; waits for one `/generate` (max_new_tokens 0) on the next
replica in turn, at most `concurrency` at once, each try within `retry`; a trajectory the teacher cannot score
raises `RewardSourceError` naming it (its step fails). Shuts down: `close()` closes the HTTP session.
"""

import asyncio
import itertools
from dataclasses import dataclass

import aiohttp

from megarl.config.reward import RetryConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.prefill_api import prefill_log_probs
from megarl.rewards.retry import with_retries


@dataclass(kw_only=True, slots=True)
class TeacherEngines:
    urls: list[str]
    """The teacher's replicas (launched on its pool, or `teacher.engines.urls`)."""
    keys: EngineKeys | None
    """Their bearer keys (None: the user's servers, no keys)."""
    retry: RetryConfig
    concurrency: int


class TeacherScorer:
    def __init__(self, engines: TeacherEngines) -> None:
        if not engines.urls:
            raise ValueError("the distillation teacher has no engine URLs")
        self.engines = engines
        self._urls = itertools.cycle(engines.urls)
        self._slots = asyncio.Semaphore(engines.concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def log_probs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """log π_T(response[j] | prompt + response[:j]) for every j (an empty response: none)."""
        if not response_ids:
            return []
        url = next(self._urls)
        async with self._slots:
            session = self._open()
            scored, _ = await with_retries(
                lambda: prefill_log_probs(session, url, self.engines.keys, prompt_ids + response_ids, len(prompt_ids)),
                self.engines.retry,
                f"the distillation teacher at {url}",
            )
        return scored.logprobs

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
