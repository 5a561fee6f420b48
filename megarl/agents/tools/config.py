"""Tool config YAML → one `BaseTool` instance per tool name.

tools:
  - class_name: megarl.agents.tools.gsm8k.CheckAnswerTool   # a BaseTool subclass
    config: {}                                                # the tool's own settings
    tool_schema: {type: function, function: {name: check_answer, description: ..., parameters: {...}}}
"""

from pathlib import Path
from typing import Any

from megarl.agents.tools.base import BaseTool
from megarl.plugins import load_class_list


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Instantiate every tool of a tool config, keyed by its function name."""
    tools: dict[str, BaseTool] = {}
    for entry in load_class_list(path, "tools", BaseTool, required=("tool_schema",)):
        schema: Any = entry.spec["tool_schema"]
        name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{entry.where} needs tool_schema.function.name")
        if name in tools:
            raise ValueError(f"{entry.where}: tool name {name!r} is defined twice")
        tools[name] = entry.cls(entry.spec.get("config") or {}, schema)
    return tools
