"""`show_colour`: a tool that answers with an image, for vision-language rollouts (issue 43's tool-image path).

The model names a colour of the shapes task's palette (`megarl.rewards.shapes.COLOURS`); the tool answers with a
56×56 PNG filled with it (four image tokens at Qwen2.5-VL's 2×2 merge of 14-pixel patches; the tiny image
processor's smallest size) and the text "This is
<colour>.", so the model can compare a colour it sees in the prompt's image with one it names.
"""

import io
from typing import Any

from PIL import Image

from megarl.agents.tools.base import BaseTool, ToolResult
from megarl.data.shapes import RGB

SIDE = 56
"""Pixels a side: 2×2 merged patches."""


def swatch(colour: str) -> bytes:
    """A PNG of one colour, `SIDE` pixels square."""
    buffer = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), RGB[colour]).save(buffer, format="PNG")
    return buffer.getvalue()


class ShowColourTool(BaseTool):
    """`{"colour": "<name>"}` → an image of that colour; an unknown name gets the palette back as text.

    create_kwargs: `ground_truth` (optional), the colour asked for; calc_reward is 1.0 when the last colour shown
    was it (as `check_answer` rewards the last answer checked), else 0.0."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self._asked: dict[str, str | None] = {}
        self._shown: dict[str, str] = {}

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        self._asked[instance_id] = create_kwargs.get("ground_truth")
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        colour = str(arguments.get("colour", "")).strip().lower()
        if colour not in RGB:
            return ToolResult(text=f"Error: name one of the colours {sorted(RGB)}.")
        self._shown[instance_id] = colour
        return ToolResult(text=f"This is {colour}.", images=[swatch(colour)], metrics={"images": 1.0})

    async def calc_reward(self, instance_id: str) -> float:
        return float(self._shown.get(instance_id) == self._asked.get(instance_id) is not None)

    async def release(self, instance_id: str) -> None:
        self._asked.pop(instance_id, None)
        self._shown.pop(instance_id, None)
