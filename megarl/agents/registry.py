"""Agent loops by name: the built-in ones, or a user's `package.module:Class` path."""

from megarl.agents.base import AgentLoop
from megarl.agents.single_turn import SingleTurnAgentLoop
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.plugins import import_callable

AGENT_LOOPS: dict[str, type[AgentLoop]] = {"single_turn": SingleTurnAgentLoop, "tool_agent": ToolAgentLoop}


def resolve_agent_loop(name: str) -> type[AgentLoop]:
    """The loop class registered as `name` (`openai`: imported when asked for), or a user's `package.module:Class`
    (an AgentLoop subclass)."""
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if name == "openai":
        from megarl.agents.openai.loop import OpenAIAgentLoop

        return OpenAIAgentLoop
    if "." not in name and ":" not in name:
        known = sorted([*AGENT_LOOPS, "openai"])
        raise ValueError(f"agent loop {name!r} is unknown; choose {known} or a `package.module:Class` path")
    cls = import_callable(name)
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ValueError(f"agent loop {name!r} is not an AgentLoop subclass (megarl.agents.base.AgentLoop)")
    return cls
