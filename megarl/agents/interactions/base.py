"""`BaseInteraction` and the interaction config loader.

An interaction is chosen per sample by `extra_info.interaction_kwargs.name`; the other keys of
`interaction_kwargs` go to `start_interaction`. After each model turn without tool calls the agent
loop asks it for the next user message:

    instance_id = await interaction.start_interaction(instance_id, **interaction_kwargs)
    reply = await interaction.generate_response(instance_id, messages)   # InteractionReply
    await interaction.finalize_interaction(instance_id)                   # always, at the end

Config YAML:

    interactions:
      - name: gsm8k                                                   # what samples refer to
        class_name: megarl.agents.interactions.gsm8k.Gsm8kInteraction
        config: {max_attempts: 3}
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.plugins import load_class_list


@dataclass(kw_only=True, slots=True)
class InteractionReply:
    done: bool
    """True ends the trajectory (the text is then not shown to the model)."""
    text: str
    """The next user message."""
    reward: float = 0.0
    """Turn reward, summed into the trajectory's loop reward."""
    metrics: dict[str, float] = field(default_factory=dict)


class BaseInteraction:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionReply:
        raise NotImplementedError(f"{type(self).__name__} does not implement generate_response()")

    async def finalize_interaction(self, instance_id: str) -> None:
        """Drop the state of one trajectory."""


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """Instantiate every interaction of an interaction config, keyed by its name."""
    found: dict[str, BaseInteraction] = {}
    for entry in load_class_list(path, "interactions", BaseInteraction, required=("name",)):
        name = entry.spec["name"]
        if name in found:
            raise ValueError(f"{entry.where}: interaction name {name!r} is defined twice")
        found[name] = entry.cls(entry.spec.get("config") or {})
    return found
