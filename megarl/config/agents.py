"""Agents outside megarl's loop API: `agents.openai.*`, the OpenAI-compatible endpoint (`agent_loop=openai`)."""

import inspect
from dataclasses import dataclass, field

from megarl.plugins import import_callable

HISTORY_REWRITE_POLICIES = ("new_segment", "fail")


@dataclass(kw_only=True, slots=True)
class OpenAIAgentConfig:
    agent: str | None = None
    """`package.module:function`, `async def run(client: openai.AsyncOpenAI, sample: dict) -> float | dict | None`,
    run once per sample of a row whose agent loop is `openai` (rollout.default_agent=openai or the row's
    agent_name); its client is bound to the sample's session."""
    on_history_rewrite: str = "new_segment"
    """A request whose messages do not extend the session's conversation (an edit, a dropped or summarised turn):
    new_segment (the trajectory goes on from a fresh encoding of the new history; the row trains on its last
    segment) | fail (the request is answered HTTP 400 and the sample ends)."""
    max_turns: int = 16
    """Chat completions per sample; later ones are answered HTTP 400 and the sample ends (`max_turns`)."""
    timeout_s: float = 600.0
    """Wall seconds of one sample's agent; past it the agent is cancelled and the tokens so far are kept."""
    in_process: bool = True
    """The agent coroutine's client reaches its session without a socket (an httpx transport into the server's
    handler, on the same event loop); false: over HTTP, as an agent in another process does (`sample["base_url"]`)."""
    host: str = "127.0.0.1"
    """Interface each agent worker's server listens on (a free port is picked); 0.0.0.0 serves agents that run on
    other machines."""
    model_name: str = "megarl"
    """The model `GET /v1/models` lists; requests may name any model (the policy answers)."""
    request_sampling: bool = False
    """Honour a request's temperature/top_p. Off: the rollout's sampling (rollout.temperature/top_p, or rollout.val
    in validation) always applies, so the trainer's log-probs match what was sampled."""


@dataclass(kw_only=True, slots=True)
class AgentsConfig:
    openai: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)


def openai_agent_problems(cfg: OpenAIAgentConfig, default_agent: str) -> list[str]:
    """What is wrong with `agents.openai.*`, each naming its key and the fix."""
    problems = []
    if cfg.on_history_rewrite not in HISTORY_REWRITE_POLICIES:
        problems.append(
            f"agents.openai.on_history_rewrite={cfg.on_history_rewrite!r} is unknown; choose one of "
            f"{list(HISTORY_REWRITE_POLICIES)}"
        )
    if cfg.max_turns < 1:
        problems.append(f"agents.openai.max_turns={cfg.max_turns} must be >= 1")
    if cfg.timeout_s <= 0:
        problems.append(f"agents.openai.timeout_s={cfg.timeout_s} must be > 0")
    if default_agent == "openai" and not cfg.agent:
        problems.append(
            "rollout.default_agent=openai needs agents.openai.agent=package.module:function "
            "(e.g. examples.openai_agent.agent:run)"
        )
    if cfg.agent:
        problems += _agent_problems(cfg.agent)
    return problems


def _agent_problems(path: str) -> list[str]:
    try:
        agent = import_callable(path)
    except ValueError as err:
        return [f"agents.openai.agent={path!r}: {err}; give `package.module:function` on PYTHONPATH"]
    if not inspect.iscoroutinefunction(agent):
        return [f"agents.openai.agent={path!r} is not an `async def run(client, sample)` coroutine function"]
    return []
