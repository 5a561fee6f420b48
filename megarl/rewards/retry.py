"""Bounded tries with exponential backoff for reward requests (`reward_model.*.retry`)."""

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from megarl.config.reward import RetryConfig
from megarl.rewards.sources import RewardSourceError

T = TypeVar("T")


class Permanent(Exception):
    """An error no retry can mend (a 4xx answer, a bad request): the source fails at once."""


class Transient(Exception):
    """An error a later try may not meet (a 5xx or 429 answer, an unparsable judge reply)."""


RETRIED = (TimeoutError, OSError, aiohttp.ClientError, Transient)
"""What a try may fail with and be tried again; anything else is a bug and propagates."""


def backoff_s(retry: RetryConfig, attempt: int, rng: random.Random) -> float:
    """The wait before try `attempt + 1` (attempt ≥ 1): backoff_s · 2^(attempt−1), capped, plus up to 10% jitter."""
    base = min(retry.backoff_s * 2 ** (attempt - 1), retry.max_backoff_s)
    return base * (1.0 + 0.1 * rng.random())


async def with_retries(call: Callable[[], Awaitable[T]], retry: RetryConfig, what: str) -> tuple[T, int]:
    """(`call()`'s result, the retries it took): each try within `retry.timeout_s`; a `Permanent` error or the last
    failed try raises `RewardSourceError` naming `what`."""
    rng = random.Random()
    attempt = 0
    while True:
        try:
            return await asyncio.wait_for(call(), retry.timeout_s), attempt
        except Permanent as error:
            raise RewardSourceError(f"{what}: {error}", attempt) from error
        except RETRIED as error:
            if attempt >= retry.max_retries:
                raise RewardSourceError(
                    f"{what} failed {attempt + 1} time(s) (reward_model.*.retry.max_retries={retry.max_retries}); "
                    f"last error: {type(error).__name__}: {error}",
                    attempt,
                ) from error
        attempt += 1
        await asyncio.sleep(backoff_s(retry, attempt, rng))
