"""Tool config YAML → one `BaseTool` instance per tool name.

tools:
  - class_name: megarl.rollout.tools.gsm8k.CheckAnswerTool   # a BaseTool subclass
    config: {}                                                # the tool's own settings
    tool_schema: {type: function, function: {name: check_answer, description: ..., parameters: {...}}}
"""

from pathlib import Path
from typing import Any

import yaml

from megarl.plugins import import_callable
from megarl.rollout.tools.base import BaseTool


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Instantiate every tool of a tool config, keyed by its function name."""
    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("tools"), list):
        raise ValueError(f"{path}: expected a mapping with a `tools:` list")
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(spec["tools"]):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ValueError(f"{where} needs class_name and tool_schema")
        cls = import_callable(entry["class_name"])
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise ValueError(f"{where}: class_name {entry['class_name']!r} is not a BaseTool subclass")
        schema: Any = entry["tool_schema"]
        name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{where} needs tool_schema.function.name")
        if name in tools:
            raise ValueError(f"{where}: tool name {name!r} is defined twice")
        tools[name] = cls(entry.get("config") or {}, schema)
    return tools
