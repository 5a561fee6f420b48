"""Reward functions, chosen per row by its `data_source`.

A reward function scores one finished trajectory::

    fn(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs) -> RewardResult

- `solution_str`: the decoded response (no prompt).
- `ground_truth`: the row's `reward_model.ground_truth`.
- `extra_info`: the row's `extra_info` (None when the row has none).
- `kwargs`: `reward.kwargs` from the config (e.g. `method: flexible`, `format_score: 0.1`), the
  same for every call; a function must accept every key the config sets.

It returns a `RewardResult`; the numeric values in `extra` are logged as metrics. A function that
extracts a final answer (GSM8K's number) may also set `answer`: validation's maj@k votes over it
(`megarl/trainer/eval_metrics.py`); a function that leaves it unset gets no maj@k. Built-in functions
register themselves for one or more data sources with `@register_reward(...)`. Setting
`reward.function=package.module:function` (or `package.module.function`) uses that function for
every row instead.
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
    """Diagnostics; the numeric ones are logged as metrics (e.g. whether the format matched)."""
    answer: str | None = None
    """The final answer read from the response, as the text votes compare (`"72"`); None = none found,
    or the function extracts none. Only validation's maj@k uses it."""


RewardFn = Callable[..., RewardResult]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` the reward function of each of `data_sources`."""
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source, e.g. @register_reward('openai/gsm8k')")

    def register(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            known = _REGISTRY.get(source)
            if known is not None and known is not fn:
                raise ValueError(
                    f"data_source {source!r} already has reward function {known.__module__}.{known.__qualname__}; "
                    "register the new function under another data_source or select it with reward.function"
                )
        _REGISTRY.update(dict.fromkeys(data_sources, fn))
        return fn

    return register


def known_data_sources() -> list[str]:
    """Data sources with a registered reward function, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str, override: str | None = None) -> RewardFn:
    """The `override` function (`reward.function`) if set, else the one registered for `data_source`."""
    if override is not None:
        return import_callable(override)
    fn = _REGISTRY.get(data_source)
    if fn is None:
        raise ValueError(
            f"no reward function for data_source {data_source!r} (known: {known_data_sources()}); register one "
            "with @megarl.rewards.register_reward or set reward.function=package.module:function"
        )
    return fn
