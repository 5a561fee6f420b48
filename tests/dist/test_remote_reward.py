"""The remote reward source against a reward service on 127.0.0.1 that fails a fifth of its calls with HTTP 500."""

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from megarl.config.reward import RemoteRMConfig, RetryConfig
from megarl.ports import free_port
from megarl.rewards.sources import Component, RewardSourceError, Trajectory
from megarl.scoring.remote import RemoteSource, remote_problems

TOKEN_ENV = "MEGARL_TEST_REMOTE_RM_TOKEN"
RETRY = RetryConfig(timeout_s=10.0, max_retries=8, backoff_s=0.01, max_backoff_s=0.02)


@dataclass
class Service:
    """Scores `response` "r<i>" as i / 100 (extra `acc` = i % 2); label "bad" gets 400, "odd" a reply without a
    score; any other call fails with 500 with probability 0.2 (seeded)."""

    rng: random.Random = field(default_factory=lambda: random.Random(0))
    calls: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    headers: list[str | None] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.headers.append(request.headers.get("Authorization"))
        self.bodies.append(body)
        self.calls[body["sample_id"]] = self.calls.get(body["sample_id"], 0) + 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.005)
            return self._answer(body)
        finally:
            self.in_flight -= 1

    def _answer(self, body: dict[str, Any]) -> web.Response:
        if body["label"] == "bad":
            return web.json_response({"error": "bad request"}, status=400)
        if body["label"] == "odd":
            return web.json_response({"verdict": "fine"})
        if self.rng.random() < 0.2:
            self.failures += 1
            return web.json_response({"error": "overloaded"}, status=500)
        i = int(body["response"][1:])
        return web.json_response({"score": i / 100, "acc": i % 2, "note": "ignored"})


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/score", service.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        await runner.cleanup()


def trajectory(i: int, label: str = "") -> Trajectory:
    prompt = [{"role": "user", "content": f"q{i}"}]
    return Trajectory(
        data_source="toy",
        messages=[*prompt, {"role": "assistant", "content": f"r{i}"}],
        prompt_messages=prompt,
        response_text=f"r{i}",
        ground_truth=label,
        extra_info={"index": i},
        sample_id=f"s{i}",
    )


def run_with(scenario: Callable[[str, Service], Coroutine[Any, Any, Any]]) -> Service:
    service = Service()

    async def main() -> None:
        async with serving(service) as url:
            await scenario(url, service)

    asyncio.run(main())
    return service


def test_every_trajectory_gets_its_score_through_retried_500s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "sesame")
    results: list[Component] = []

    async def scenario(url: str, service: Service) -> None:
        source = RemoteSource(RemoteRMConfig(url=url, auth_env=TOKEN_ENV, concurrency=4, retry=RETRY))
        results.extend(await asyncio.gather(*(source.score(trajectory(i)) for i in range(40))))
        await source.close()

    service = run_with(scenario)
    assert [r.value for r in results] == [i / 100 for i in range(40)]
    assert [r.extra for r in results] == [{"acc": float(i % 2)} for i in range(40)]
    assert [r.retries for r in results] == [service.calls[f"s{i}"] - 1 for i in range(40)]
    assert sum(r.retries for r in results) == service.failures > 0
    assert set(service.headers) == {"Bearer sesame"}
    assert 1 < service.most_in_flight <= 4
    first = next(b for b in service.bodies if b["sample_id"] == "s3")
    assert first == {
        "prompt": "q3",
        "response": "r3",
        "label": "",
        "messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "r3"}],
        "data_source": "toy",
        "extra_info": {"index": 3},
        "sample_id": "s3",
    }


def test_a_400_and_a_reply_without_a_score_fail_at_once() -> None:
    errors: list[RewardSourceError] = []

    async def scenario(url: str, service: Service) -> None:
        source = RemoteSource(RemoteRMConfig(url=url, retry=RETRY))
        for i, label in enumerate(["bad", "odd"]):
            with pytest.raises(RewardSourceError) as caught:
                await source.score(trajectory(i, label))
            errors.append(caught.value)
        await source.close()

    service = run_with(scenario)
    assert service.calls == {"s0": 1, "s1": 1}
    assert [e.retries for e in errors] == [0, 0]
    assert "HTTP 400" in str(errors[0]) and "sample 's0'" in str(errors[0])
    assert '{"verdict": "fine"}' in str(errors[1]) and "numeric score" in str(errors[1])
    assert service.headers == [None, None]  # no auth_env, no header


def test_a_missing_token_variable_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = RemoteRMConfig(url="http://127.0.0.1:1/score", auth_env=TOKEN_ENV)
    with pytest.raises(ValueError, match=f"auth_env='{TOKEN_ENV}' names an environment variable that is not set"):
        RemoteSource(cfg)
    assert any(TOKEN_ENV in p for p in asyncio.run(remote_problems(cfg)))


def test_remote_problems_reports_an_unreachable_url_and_accepts_any_answer() -> None:
    dead = f"http://127.0.0.1:{free_port()}/score"
    problems = asyncio.run(remote_problems(RemoteRMConfig(url=dead)))
    assert len(problems) == 1 and dead in problems[0] and "does not answer" in problems[0]
    found: list[list[str]] = []

    async def scenario(url: str, service: Service) -> None:
        found.append(await remote_problems(RemoteRMConfig(url=url)))  # a GET on a POST route: 405 is an answer

    run_with(scenario)
    assert found == [[]]
