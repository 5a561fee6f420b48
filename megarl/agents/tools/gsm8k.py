"""`check_answer`: tells the model whether its GSM8K answer is right; rewards the last answer checked."""

from dataclasses import dataclass
from typing import Any

from megarl.agents.tools.base import BaseTool, ToolResult
from megarl.rewards.gsm8k import answers_match


@dataclass(slots=True)
class _Instance:
    ground_truth: str
    last_correct: bool = False
    num_checks: int = 0


class CheckAnswerTool(BaseTool):
    """create_kwargs: `ground_truth`. Each call compares `arguments["answer"]` with it; calc_reward is
    1.0 when the last answer checked was right, else 0.0. config `penalty` (default 0.0) is the step
    reward of every call after the first, to discourage guessing by repeated calls."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self.penalty = float(config.get("penalty", 0.0))
        self._instances: dict[str, _Instance] = {}

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        if "ground_truth" not in create_kwargs:
            raise ValueError(f"tool {self.name!r} needs create_kwargs.ground_truth in the sample's tools_kwargs")
        self._instances[instance_id] = _Instance(str(create_kwargs["ground_truth"]))
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        state = self._instances[instance_id]
        answer = arguments.get("answer")
        if not isinstance(answer, str | int | float):
            return ToolResult(text='Error: pass the answer as {"answer": "<number>"}.')
        state.num_checks += 1
        state.last_correct = answers_match(str(answer), state.ground_truth)
        reward = self.penalty if state.num_checks > 1 else 0.0
        verdict = "correct" if state.last_correct else "wrong"
        metrics = {"correct": float(state.last_correct)}
        return ToolResult(text=f"The answer {answer} is {verdict}.", reward=reward, metrics=metrics)

    async def calc_reward(self, instance_id: str) -> float:
        return 1.0 if self._instances[instance_id].last_correct else 0.0

    async def release(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)
