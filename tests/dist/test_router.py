"""The router over two embedded engine processes: sticky trajectories, least-load spread, failover."""

import asyncio
import logging
import os
import signal
from collections.abc import Iterator

import pytest
from cases.engine_cases import engine_client, generate_batch, router_of, run, save_engine_model, start_engine

from megarl.engines.client.router import NoReplicaAvailable, Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.replicas.server_process import ServerProcess
from megarl.ports import free_port

Engines = list[tuple[ServerProcess, str]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    model = save_engine_model(tmp_path_factory.mktemp("router") / "model", hidden=64, layers=2)
    logs = tmp_path_factory.mktemp("logs")
    started = [start_engine(model, logs), start_engine(model, logs)]
    yield started
    for server, _ in started:
        server.stop()


def test_turns_of_a_trajectory_stay_on_one_replica(engines: Engines) -> None:
    async def scenario() -> tuple[list[list[int]], list[int], list[tuple[int, int]]]:
        router = router_of([url for _, url in engines])
        prompts = {t: [3, 4, 40 + t] for t in range(6)}
        served_per_turn, cached = [], []
        for turn in range(3):
            sent = [len(prompts[t]) for t in range(6)]
            results = await asyncio.gather(
                *(
                    router.generate(prompts[t], SamplingParams(max_new_tokens=4), trajectory_id=f"traj-{t}")
                    for t in range(6)
                )
            )
            for t, (result,) in enumerate(results):  # the next turn: the conversation so far + a tool reply
                prompts[t] = prompts[t] + result.output_ids + [7, turn]
            cached += [(r[0].cached_tokens, sent[t]) for t, r in enumerate(results)] if turn else []
            served_per_turn.append([r.served for r in router.replicas])
        sticky = [router.pick(f"traj-{t}") for t in range(6)]
        await router.close()
        return served_per_turn, sticky, cached

    served_per_turn, replica_of, cached = run(scenario())
    assert served_per_turn[0] == [3, 3] and served_per_turn[-1] == [9, 9]
    assert sorted(replica_of) == [0, 0, 0, 1, 1, 1]
    # each later turn found all of its previous turn (prompt + output but the last token) in its replica's cache
    assert all(hit == length - 3 for hit, length in cached), cached


def test_sticky_map_is_lru_bounded(engines: Engines) -> None:
    router = router_of([url for _, url in engines], sticky_capacity=2)
    first = router.pick("a")
    router.pick("b")
    router.pick("c")
    assert list(router._sticky) == ["b", "c"]
    assert router.pick("b") == router._sticky["b"]
    router.pick("a")
    assert list(router._sticky) == ["b", "a"] and router._sticky["a"] in (0, 1) and first in (0, 1)


def test_least_loaded_replica_gets_each_request(engines: Engines) -> None:
    async def scenario() -> tuple[list[int], list[list[int]]]:
        router = router_of([url for _, url in engines])
        results = await generate_batch(router, [[1, 2, i] for i in range(16)], SamplingParams(max_new_tokens=8, n=2))
        served = [r.served for r in router.replicas]
        await router.close()
        return served, [[len(s.output_ids) for s in r] for r in results]

    served, lengths = run(scenario())
    assert served == [8, 8]
    assert all(len(samples) == 2 for samples in lengths)


def test_requests_of_a_killed_replica_finish_on_the_other(engines: Engines, caplog: pytest.LogCaptureFixture) -> None:
    victim = engines[1][0]
    sampling = SamplingParams(max_new_tokens=300, ignore_eos=True, temperature=1.0)

    async def scenario() -> tuple[list, list[bool]]:
        router = router_of([url for _, url in engines])
        batch = asyncio.create_task(generate_batch(router, [[7, 8, i] for i in range(16)], sampling))
        while router.replicas[1].in_flight < 8:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        os.kill(victim.pid, signal.SIGKILL)
        results = await batch
        await router.check_health()
        alive = [r.alive for r in router.replicas]
        await router.close()
        return results, alive

    with caplog.at_level(logging.WARNING, logger="megarl.engines.client.router"):
        results, alive = run(scenario())
    assert alive == [True, False]
    assert all(r[0].finish_reason.type == "length" and len(r[0].output_ids) == 300 for r in results)
    assert any(engines[1][1] in m and "is down" in m for m in caplog.messages)

    async def only_dead() -> None:
        router = Router([engine_client(engines[1][1])])
        try:
            await router.generate([1], SamplingParams(max_new_tokens=2))
        finally:
            await router.close()

    with pytest.raises(NoReplicaAvailable, match=engines[1][1]):
        run(only_dead())


def test_health_loop_marks_unreachable_replicas_dead(engines: Engines) -> None:
    async def scenario() -> list[bool]:
        router = Router([engine_client(engines[0][1]), engine_client(f"http://127.0.0.1:{free_port()}")])
        router.health_interval_s = 0.2
        router.start_health_checks()
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not router.replicas[1].alive:
                break
        alive = [r.alive for r in router.replicas]
        await router.close()
        return alive

    assert run(scenario()) == [True, False]
