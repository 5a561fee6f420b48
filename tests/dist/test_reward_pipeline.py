"""The agent worker's reward pipeline (megarl/scoring/pipeline.py) with a real remote source: `reward_model.on_error`
(fail names the sample and source, default_score scores the default and counts the error, skip_sample marks the
row), weights combining the components, and a slow rule function in the process pool leaving the event loop free."""

import asyncio
import time

import pytest
from test_remote_reward import Service, serving, trajectory

from megarl.config.reward import RemoteRMConfig, RetryConfig, RewardModelConfig
from megarl.config.trainer import RewardConfig
from megarl.scoring.pipeline import RewardPipeline, RewardSettings, RowScore

FAST = RetryConfig(timeout_s=5.0, max_retries=2, backoff_s=0.01, max_backoff_s=0.01)


def _pipeline(url: str, on_error: str) -> RewardPipeline:
    models = RewardModelConfig(
        remote=RemoteRMConfig(url=url, weight=2.0, retry=FAST), on_error=on_error, default_score=-1.0, rule_weight=0.5
    )
    return RewardPipeline(RewardSettings(reward=RewardConfig(num_workers=0), models=models))


def _score(on_error: str, label: str) -> RowScore:
    async def main() -> RowScore:
        async with serving(Service()) as url:
            pipeline = _pipeline(url, on_error)
            try:
                return await pipeline.score(trajectory(7, label), loop_reward=1.0)
            finally:
                await pipeline.close()

    return asyncio.run(main())


def test_components_combine_by_their_weights() -> None:
    row = _score("fail", label="")
    assert row.extra["rule"] == 1.0 and row.extra["remote"] == 0.07 and row.extra["remote/acc"] == 1.0
    assert row.score == pytest.approx(0.5 * 1.0 + 2.0 * 0.07)
    assert row.stats["errors"] == 0.0 and row.stats["skipped"] == 0.0


def test_on_error_fail_names_the_sample_and_the_source() -> None:
    with pytest.raises(RuntimeError, match=r"reward source 'remote' failed on sample s7 \(data_source 'toy'\)"):
        _score("fail", label="bad")  # the service answers 400: no retry, then on_error


def test_on_error_default_score_and_skip_sample_count_the_error() -> None:
    row = _score("default_score", label="bad")
    assert row.extra["remote"] == -1.0 and row.score == pytest.approx(0.5 - 2.0)
    assert row.stats["errors"] == 1.0 and row.stats["skipped"] == 0.0
    skipped = _score("skip_sample", label="bad")
    assert skipped.stats["errors"] == 1.0 and skipped.stats["skipped"] == 1.0


def test_a_slow_rule_in_the_process_pool_leaves_the_event_loop_free() -> None:
    reward = RewardConfig(function="cases.reward_cases:slow_rule", num_workers=1)
    pipeline = RewardPipeline(RewardSettings(reward=reward, models=RewardModelConfig()))

    async def main() -> tuple[RowScore, int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            await pipeline.score(trajectory(1), loop_reward=None)  # the pool's process starts
            started, ticks = time.perf_counter(), 0
            row = await pipeline.score(trajectory(2), loop_reward=None)
            return row, ticks, time.perf_counter() - started
        finally:
            ticker.cancel()
            await pipeline.close()

    row, ticks, seconds = asyncio.run(main())
    assert row.score == 2.0
    # the loop ticked through the rule's one long C call (in a thread, which holds the GIL for it, it would not)
    assert ticks >= 0.3 * seconds / 0.01, (ticks, seconds)
