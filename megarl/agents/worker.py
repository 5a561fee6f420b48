"""`AgentWorker`: a Ray actor (CPU only) that runs one asyncio task per sample through its agent loop.

Consumes: a `Batch` of prompt rows (`raw_prompt_ids`, `raw_prompt`, and optionally `agent_name`,
`tools_kwargs`, `extra_info.interaction_kwargs`). Waits for: every sample's loop (engine requests
through its own router, tool calls, interactions). Returns: the padded rollout `Batch` of those rows
in order and its wall seconds. `use_adapter(name)` (after each LoRA adapter sync) switches the LoRA adapter its
requests name. Shutdown: `close()` waits for the adapter unloads under way and closes the router's HTTP sessions;
Ray kills the actor with the manager.
"""

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from megarl.agents.base import AgentContext, AgentLoop, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.interactions.base import load_interactions
from megarl.agents.postprocess import response_texts, to_batch
from megarl.agents.registry import resolve_agent_loop
from megarl.agents.tool_parsers import make_parser
from megarl.agents.tools.config import load_tools
from megarl.batch import Batch
from megarl.config.rollout import RolloutConfig, SamplingConfig
from megarl.config.root import MegarlConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams


@dataclass(kw_only=True, slots=True)
class AgentSettings:
    rollout: RolloutConfig
    tokenizer_path: str
    prompt_length: int
    response_length: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    resume_aborted: bool = False
    """Resubmit samples the engines abort (pause_generation in abort mode around a weight update) with their
    partial output, so each loop sees whole turns (`Router(resume_aborted=True)`)."""
    routed_experts: bool = False
    """Ask the engines for each token's routed experts (`actor.router_replay=R3`); training rollouts only."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig) -> "AgentSettings":
        """rollout.*, the model's tokenizer and data.max_prompt_length / max_response_length; aborted requests are
        resumed when asynchronous training pauses the engines in abort mode."""
        return cls(
            rollout=cfg.rollout,
            tokenizer_path=cfg.model.tokenizer_path or cfg.model.path,
            prompt_length=cfg.data.max_prompt_length,
            response_length=cfg.data.max_response_length,
            chat_template_kwargs=dict(cfg.data.chat_template_kwargs),
            resume_aborted=cfg.trainer.driver == "fully_async" and cfg.async_training.pause_mode == "abort",
            routed_experts=cfg.actor.router_replay == "R3",
        )


def sampling_for(cfg: RolloutConfig, validate: bool) -> SamplingParams:
    """Training sampling (rollout.temperature/top_p/top_k) or validation sampling (rollout.val.*)."""
    source: RolloutConfig | SamplingConfig = cfg.val if validate else cfg
    return SamplingParams(temperature=source.temperature, top_p=source.top_p, top_k=source.top_k)


class AgentWorker:
    def __init__(self, settings: AgentSettings, urls: list[str], keys: EngineKeys | None = None) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        mt = settings.rollout.multi_turn
        self._context = AgentContext(
            router=Router.from_config(settings.rollout, urls, keys, resume_aborted=settings.resume_aborted),
            chat=ChatTokens(tokenizer, settings.chat_template_kwargs),
            response_length=settings.response_length,
            multi_turn=mt,
            tools=load_tools(mt.tool_config_path) if mt.tool_config_path else {},
            interactions=load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {},
            parser=make_parser(mt.tool_call_parser),
            routed_experts=settings.routed_experts,
        )
        self._loops: dict[str, AgentLoop] = {}

    async def rollout_rows(self, rows: Batch, validate: bool, seed: int | None, first_row: int) -> tuple[Batch, float]:
        """Roll out every row concurrently; row i samples with seed `seed + 1000 * (first_row + i)` (+ turn)."""
        started = time.perf_counter()
        sampling = sampling_for(self.settings.rollout, validate)
        runs = []
        for i in range(len(rows)):
            name = rows["agent_name"][i] if "agent_name" in rows else self.settings.rollout.default_agent
            sample = row_sample(rows, i, None if seed is None else seed + 1000 * (first_row + i))
            runs.append(self._loop(name).run(sample, sampling))
        outputs = await asyncio.gather(*runs)
        batch = to_batch(list(outputs), self.settings.prompt_length, self.settings.response_length, self.pad_token_id)
        batch.set("response_text", response_texts(list(outputs), self._context.chat.tokenizer))
        return batch, time.perf_counter() - started

    def _loop(self, name: str) -> AgentLoop:
        if name not in self._loops:
            self._loops[name] = resolve_agent_loop(name)(self._context)
        return self._loops[name]

    def engine_health(self) -> tuple[list[bool], int]:
        """(whether this worker's router takes each replica, the requests it retried on another replica)."""
        router = self._context.router
        return [r.alive for r in router.replicas], router.retried_requests

    async def readmit(self) -> tuple[list[bool], int]:
        """Ask every replica for its health now: the ones that answer (a restarted replica, after its sync) are
        taken again; then `engine_health`."""
        await self._context.router.check_health()
        return self.engine_health()

    async def use_adapter(self, name: str | None) -> None:
        """Every engine request from now on names LoRA adapter `name` (None: the base model), which the trainer has
        loaded on every replica; the previous adapter is unloaded once this worker's requests with it have ended
        (`Router.use_adapter`). Async, so it runs on the event loop the rollouts run on."""
        self._context.router.use_adapter(name)

    async def close(self) -> None:
        """Wait for the adapter unloads under way, close the router's HTTP sessions."""
        await self._context.router.close()


def row_sample(rows: Batch, i: int, seed: int | None) -> AgentSample:
    """Row `i` of a prompt batch (collate_prompts' columns) as an agent-loop sample with a fresh id."""
    extra = rows["extra_info"][i] if "extra_info" in rows else {}
    extra = extra or {}
    return AgentSample(
        sample_id=uuid.uuid4().hex,
        prompt_ids=list(rows["raw_prompt_ids"][i]),
        messages=list(rows["raw_prompt"][i]) if "raw_prompt" in rows else [],
        tools_kwargs=(rows["tools_kwargs"][i] if "tools_kwargs" in rows else None) or {},
        interaction_kwargs=extra.get("interaction_kwargs"),
        seed=seed,
    )
