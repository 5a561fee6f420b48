"""The remote reward service (`reward_model.remote`): one JSON POST to `url` per trajectory.

Modelled on slime's `--rm-url` (`slime/rollout/rm_hub/__init__.py::remote_rm`, which posts prompt, response and
label and takes the JSON reply as the reward), with the whole conversation added.

Request body (`request_body`)::

    {"prompt": "<the last user message of the prompt>",
     "response": "<the response decoded: model and tool/user turns, special tokens dropped>",
     "label": "<the row's reward_model.ground_truth, or "">",
     "messages": [{"role": ..., "content": ...}, ...],   # prompt messages, then the response's turns
     "data_source": "<the row's data_source>",
     "extra_info": {...},                                 # the row's extra_info
     "sample_id": "<unique per trajectory>"}

Reply (`parse_reply`): a JSON number, or an object with a numeric `score` (or `reward`) and optional numeric
extras (`{"score": 0.8, "acc": 1}`), logged as `reward/remote/<key>/mean`; other keys are ignored.

Failures: HTTP 429 and 5xx, connection errors and timeouts are tried again (`reward_model.remote.retry`); any
other non-2xx answer, and a reply that is not JSON or has no numeric score, fail the sample at once. With
`auth_env` set, each request carries `Authorization: Bearer $<auth_env>`.
"""

import asyncio
import json
import os
from typing import Any

import aiohttp

from megarl.config.reward import RemoteRMConfig
from megarl.rewards.retry import Permanent, Transient, with_retries
from megarl.rewards.sources import Component, Trajectory

PROBE_TIMEOUT_S = 10.0
"""How long `remote_problems` waits for the service to answer."""


def request_body(trajectory: Trajectory) -> dict[str, Any]:
    """The JSON object posted for `trajectory` (the module docstring's request body)."""
    return {
        "prompt": trajectory.prompt_text,
        "response": trajectory.response_text,
        "label": trajectory.ground_truth,
        "messages": trajectory.messages,
        "data_source": trajectory.data_source,
        "extra_info": trajectory.extra_info,
        "sample_id": trajectory.sample_id,
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_reply(reply: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) of a service's JSON reply; `Permanent` quoting it when it holds no numeric score."""
    if _is_number(reply):
        return float(reply), {}
    if isinstance(reply, dict):
        score = reply.get("score", reply.get("reward"))
        if isinstance(score, int | float) and not isinstance(score, bool):
            extra = {k: float(v) for k, v in reply.items() if k not in ("score", "reward") and _is_number(v)}
            return float(score), extra
    raise Permanent(f"the reply {json.dumps(reply)[:300]} is neither a number nor an object with a numeric score")


def _jsonable(value: Any) -> Any:
    """numpy arrays and scalars (a parquet row's extra_info) as lists and numbers; anything else as its str."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    """POST `body` to `url`; the JSON reply. HTTP 429 and 5xx raise `Transient`, other non-2xx answers and a
    reply that is not JSON `Permanent`; connection errors propagate (`with_retries` tries them again)."""
    data = json.dumps(body, default=_jsonable)
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        text = await resp.text()
        if resp.status == 429 or resp.status >= 500:
            raise Transient(f"POST {url} returned HTTP {resp.status}: {text[:300]}")
        if not 200 <= resp.status < 300:
            raise Permanent(f"POST {url} returned HTTP {resp.status}: {text[:300]}")
    try:
        return json.loads(text)
    except ValueError:
        raise Permanent(f"POST {url} answered {text[:300]!r}, which is not JSON") from None


def new_session() -> aiohttp.ClientSession:
    """A pooled session without its own deadline (`with_retries` bounds each try)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


def _auth_problem(auth_env: str | None) -> str | None:
    if auth_env is not None and not os.environ.get(auth_env):
        return f"reward_model.remote.auth_env={auth_env!r} names an environment variable that is not set"
    return None


class RemoteSource:
    """Scores each trajectory by a POST to `reward_model.remote.url`, at most `concurrency` at a time."""

    name = "remote"

    def __init__(self, cfg: RemoteRMConfig) -> None:
        if cfg.url is None:
            raise ValueError("reward_model.remote.url is not set")
        if problem := _auth_problem(cfg.auth_env):
            raise ValueError(problem)
        self.cfg, self.url = cfg, cfg.url
        token = os.environ[cfg.auth_env] if cfg.auth_env else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def _try(self, body: dict[str, Any]) -> tuple[float, dict[str, float]]:
        if self._session is None or self._session.closed:
            self._session = new_session()
        return parse_reply(await post_json(self._session, self.url, body, self._headers))

    async def score(self, trajectory: Trajectory) -> Component:
        body = request_body(trajectory)
        what = f"remote reward {self.url} for sample {trajectory.sample_id!r}"
        async with self._slots:  # held across retries: the wait for a slot is not part of a try's timeout
            (value, extra), retries = await with_retries(lambda: self._try(body), self.cfg.retry, what)
        return Component(value, extra, retries)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None


async def remote_problems(cfg: RemoteRMConfig) -> list[str]:
    """Start-up check of `reward_model.remote`: its token's variable is set and its URL answers at all (any HTTP
    status counts; a refused connection, an unknown host or no answer in PROBE_TIMEOUT_S is a problem)."""
    if cfg.url is None:
        return []
    problems = [p for p in [_auth_problem(cfg.auth_env)] if p]
    timeout = aiohttp.ClientTimeout(total=min(PROBE_TIMEOUT_S, cfg.retry.timeout_s))
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(cfg.url):
            pass
    except (aiohttp.ClientError, OSError, TimeoutError) as error:
        problems.append(f"reward_model.remote.url={cfg.url!r} does not answer: {type(error).__name__}: {error}")
    return problems
