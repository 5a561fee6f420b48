"""What a reward source sees of a finished trajectory, and what it gives back.

A source (`megarl.rewards.pipeline` runs them) scores one `Trajectory` into one `Component`: its value, its
numeric extras (logged as `reward/<source>/<key>/mean`) and the tries it took. A source that still fails after its
retries raises `RewardSourceError`; the pipeline then applies `reward_model.on_error`.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Trajectory:
    data_source: str
    messages: list[dict[str, Any]]
    """The whole conversation: the prompt's messages, then the response's turns (assistant, tool, user)."""
    prompt_messages: list[dict[str, Any]]
    """The prompt's messages alone."""
    response_text: str
    """The response decoded (model and tool/user tokens, special tokens dropped): what rule functions score."""
    ground_truth: str
    """The row's `reward_model.ground_truth` ("" when it has none)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    sample_id: str = ""
    """Unique per trajectory (error messages, request ids)."""

    @property
    def prompt_text(self) -> str:
        """The last user message of the prompt (what a judge is asked about)."""
        users = [str(m.get("content", "")) for m in self.prompt_messages if m.get("role") == "user"]
        return users[-1] if users else ""


@dataclass(frozen=True, slots=True)
class Component:
    value: float
    extra: dict[str, float] = field(default_factory=dict)
    retries: int = 0
    """Tries beyond the first that this score took."""


class RewardSourceError(RuntimeError):
    """A source that failed every try (its last error chained); `retries` = the tries after the first."""

    def __init__(self, message: str, retries: int = 0) -> None:
        super().__init__(message)
        self.retries = retries


class RewardSource(Protocol):
    name: str
    """The component's name: rule | rm | judge | remote."""

    async def score(self, trajectory: Trajectory) -> Component: ...

    async def close(self) -> None: ...
