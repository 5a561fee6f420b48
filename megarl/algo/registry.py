"""Name → function registries for the pluggable pieces of the algorithm.

Each registry maps config names (`algorithm.adv_estimator=grpo`) to functions. A name that is
not registered but contains a dot or colon is imported as `package.module:function`, so users
plug in their own function from config without touching megarl::

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]: ...

or `algorithm.adv_estimator=my_pkg.estimators:my_estimator` with no registration at all.
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from megarl.plugins import import_callable

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Functions of one kind, by name; `field` is the config field that selects them (for errors)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self._fns: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering `fn` under each of `names` (aliases share one function)."""

        def add(fn: F) -> F:
            for name in names:
                known = self._fns.get(name)
                if known is not None and known is not fn:
                    raise ValueError(f"{self.field}: {name!r} is already registered to {known.__qualname__}")
                self._fns[name] = fn
            return fn

        return add

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._fns))

    def get(self, name: str) -> F:
        """The function registered as `name`, or imported from the dotted path `name`."""
        fn = self._fns.get(name)
        if fn is not None:
            return fn
        if "." in name or ":" in name:
            imported: F = import_callable(name)  # type: ignore[assignment]
            return imported
        raise ValueError(
            f"{self.field}={name!r} is unknown; choose one of {', '.join(self.names())} "
            "or give `package.module:function`"
        )
