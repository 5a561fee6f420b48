"""Asynchronous off-policy training: rollout on its own pool overlapping the updates (docs/async.md)."""

from dataclasses import dataclass

from megarl.config.trainer import ASYNC_DRIVERS

PAUSE_MODES = ("abort", "retract", "in_place")
STALE_POLICIES = ("recycle", "drop")


@dataclass(kw_only=True, slots=True)
class AsyncTrainingConfig:
    max_staleness: int = 1
    """Per sample: the trainer's current weight version minus the version of the sample's oldest token may be at
    most this (0 = on-policy: fully_async then trains exactly what the synchronous trainer would)."""
    max_in_flight: int = 0
    """fully_async: prompt groups being rolled out at once at most; 0 = as many as the buffer capacity allows
    (long-tail rollouts need more in flight than one batch to keep the trainer fed)."""
    buffer_groups: int = 0
    """fully_async: finished groups waiting for the trainer; the producer stops starting groups while
    in-flight + buffered reach it (back-pressure). 0 = 2 × data.train_batch_size; at least one batch."""
    stale_policy: str = "recycle"
    """fully_async: a taken group older than max_staleness is recycled (its prompt is rolled out again, so every
    prompt still trains once per epoch) or dropped (counted in async/dropped_groups)."""
    sync_every: int = 1
    """fully_async: push the weights to the engines every this many steps."""
    pause_mode: str = "retract"
    """How in-flight requests cross a weight push (SGLang 0.5.23 /pause_generation): abort (the engine returns the
    partial output; the agent side resubmits prompt + partial response) | retract (the engine re-prefills them with
    the new weights) | in_place (the engine keeps their KV and continues)."""


def async_problems(cfg: AsyncTrainingConfig, driver: str, placement: str, train_batch_size: int) -> list[str]:
    """What is wrong with `async_training` under `trainer.driver`, one sentence each (empty: fine)."""
    key = "async_training"
    checks = [
        (cfg.max_staleness >= 0, f"{key}.max_staleness={cfg.max_staleness} must be >= 0 (0 = on-policy)"),
        (cfg.max_in_flight >= 0, f"{key}.max_in_flight={cfg.max_in_flight} must be >= 0 (0 = up to buffer_groups)"),
        (
            cfg.buffer_groups == 0 or cfg.buffer_groups >= train_batch_size,
            f"{key}.buffer_groups={cfg.buffer_groups} is smaller than one batch (data.train_batch_size="
            f"{train_batch_size}); raise it or set 0 for twice the batch",
        ),
        (
            cfg.stale_policy in STALE_POLICIES,
            f"{key}.stale_policy={cfg.stale_policy!r} is unknown; choose one of {', '.join(STALE_POLICIES)}",
        ),
        (cfg.sync_every >= 1, f"{key}.sync_every={cfg.sync_every} must be >= 1"),
        (
            cfg.pause_mode in PAUSE_MODES,
            f"{key}.pause_mode={cfg.pause_mode!r} is unknown; choose one of {', '.join(PAUSE_MODES)}",
        ),
        (
            driver not in ASYNC_DRIVERS or placement == "separate",
            f"trainer.driver={driver} overlaps rollout with training, so the engines need their own devices: "
            "set trainer.placement=separate (colocated engines sleep while the trainer runs)",
        ),
        (
            driver != "fully_async" or cfg.sync_every <= cfg.max_staleness + 1,
            f"{key}.sync_every={cfg.sync_every} with max_staleness={cfg.max_staleness}: the engines would lag the "
            f"trainer by up to sync_every − 1 versions, so every sample would be too old; set sync_every <= "
            f"{cfg.max_staleness + 1}",
        ),
    ]
    return [message for ok, message in checks if not ok]


def buffer_capacity(cfg: AsyncTrainingConfig, train_batch_size: int) -> int:
    """Groups in flight plus buffered at most (`buffer_groups`, default two batches)."""
    return cfg.buffer_groups or 2 * train_batch_size


def in_flight_limit(cfg: AsyncTrainingConfig, train_batch_size: int) -> int:
    """Groups rolled out at once at most (`max_in_flight`, default the buffer capacity)."""
    return cfg.max_in_flight or buffer_capacity(cfg, train_batch_size)
