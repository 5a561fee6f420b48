"""A simulated teacher for GSM8K: says whether the last answer is right and asks for another try."""

from typing import Any

from megarl.agents.interactions.base import BaseInteraction, InteractionReply
from megarl.rewards.gsm8k import answers_match, extract_answer


class Gsm8kInteraction(BaseInteraction):
    """interaction_kwargs: `ground_truth`. config `max_attempts` (default 2): wrong answers tolerated
    before the trajectory ends. A right answer ends it with turn reward 1.0."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.max_attempts = int(config.get("max_attempts", 2))
        self._state: dict[str, tuple[str, int]] = {}

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        if "ground_truth" not in kwargs:
            raise ValueError("Gsm8kInteraction needs interaction_kwargs.ground_truth in the sample's extra_info")
        self._state[instance_id] = (str(kwargs["ground_truth"]), 0)
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionReply:
        ground_truth, attempts = self._state[instance_id]
        attempts += 1
        self._state[instance_id] = (ground_truth, attempts)
        last = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        answer = extract_answer(last, method="strict")
        if answer is not None and answers_match(answer, ground_truth):
            return InteractionReply(done=True, text="Correct.", reward=1.0, metrics={"attempts": attempts})
        done = attempts >= self.max_attempts
        hint = "Your answer is wrong." if answer is not None else 'I could not find a final line "#### <number>".'
        return InteractionReply(done=done, text=f"{hint} Please try again.", metrics={"attempts": attempts})

    async def finalize_interaction(self, instance_id: str) -> None:
        self._state.pop(instance_id, None)
