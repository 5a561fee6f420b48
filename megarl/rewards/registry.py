"""Reward functions by `data_source`.

A reward function scores one finished trajectory::

    fn(solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs) -> RewardResult

`solution_str` is the decoded response, `ground_truth` the row's `reward_model.ground_truth`,
`extra_info` the row's `extra_info`, and `kwargs` come from `reward.kwargs` in the config (e.g.
`method: flexible`). Built-in functions register themselves for one or more data sources with
`@register_reward(...)`; `reward.function=package.module:function` replaces them for every row.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.plugins import import_callable


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float
    """The scalar reward of the trajectory."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Diagnostics logged as metrics (e.g. the extracted answer, accuracy)."""


RewardFn = Callable[..., RewardResult]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as the reward of each of `data_sources`."""

    def register(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            known = _REGISTRY.get(source)
            if known is not None and known is not fn:
                raise ValueError(
                    f"data_source {source!r} already has reward function {known.__module__}.{known.__qualname__}"
                )
            _REGISTRY[source] = fn
        return fn

    return register


def known_data_sources() -> list[str]:
    """Data sources with a registered reward function."""
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str, override: str | None = None) -> RewardFn:
    """The reward function for rows of `data_source`, or the `override` path (reward.function) if set."""
    if override is not None:
        return import_callable(override)
    try:
        return _REGISTRY[data_source]
    except KeyError:
        raise ValueError(
            f"no reward function for data_source {data_source!r} (known: {known_data_sources()}); register one "
            "with @megarl.rewards.register_reward or set reward.function=package.module:function"
        ) from None
