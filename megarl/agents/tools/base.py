"""`BaseTool`: the interface every tool implements, one instance per tool shared by all trajectories.

Lifecycle per trajectory (the agent loop drives it):

    instance_id = await tool.create(instance_id, **create_kwargs)        # once, before the first call
    result = await tool.execute(instance_id, arguments, **execute_kwargs)  # once per tool call
    reward = await tool.calc_reward(instance_id)                          # when the trajectory ends
    await tool.release(instance_id)                                       # always, even after an error

`create_kwargs` / `execute_kwargs` come from the sample's `tools_kwargs[tool_name]`. A tool keeps
per-trajectory state keyed by `instance_id`; it must not block the event loop (run blocking work in a
thread or a subprocess).
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class ToolResult:
    text: str
    """The tool message the model reads next."""
    reward: float = 0.0
    """Step reward of this call (summed into the trajectory's loop reward)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-call numbers, aggregated per sample as `tool_metrics`."""
    images: list[Any] = field(default_factory=list)
    """Images the model sees before `text` (encoded bytes or base64; vision-language models only)."""


class BaseTool:
    """A tool with an OpenAI function schema (`tool_schema`) and its YAML `config`."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config = config
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        """Set up the state of one trajectory; returns the instance id the other calls receive."""
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        """Run one call with the model's `arguments` (already parsed JSON)."""
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement execute()")

    async def calc_reward(self, instance_id: str) -> float:
        """The trajectory-level reward this tool gives when the trajectory ends (0 by default)."""
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Drop the state of one trajectory."""
