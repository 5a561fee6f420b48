"""`AgentWorker`: a Ray actor (CPU only) that runs one asyncio task per sample through its agent loop, then scores it.

Consumes: a `Batch` of prompt rows (`raw_prompt_ids`, `raw_prompt`, `data_source`, `reward_model`, and optionally
`agent_name`, `tools_kwargs`, `extra_info.interaction_kwargs`). Waits for: every sample's loop (engine requests
through its own router, tool calls, interactions) and its score (`megarl.scoring.pipeline`: as each trajectory
finishes under `reward.overlap`, else once all have). Returns: the padded rollout `Batch` of those rows in order,
with `scores`, `reward_extra`, `reward_answer`, `reward_stats` (and `rm_token_ids` for a Megatron RM; the engine
teacher's `teacher_log_probs` `[B, R]` in training rollouts with on-policy distillation on engines), and its wall
seconds. `use_adapter(name)` (after each LoRA adapter sync) switches the LoRA adapter its
requests name. Shutdown: `close()` waits for the adapter unloads under way and closes the router's HTTP sessions;
Ray kills the actor with the manager.
"""

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.agents.base import AgentContext, AgentLoop, AgentOutput, AgentSample
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.images import TrajectoryImages, to_base64
from megarl.agents.interactions.base import load_interactions
from megarl.agents.postprocess import RoutingLayout, response_texts, to_batch
from megarl.agents.registry import resolve_agent_loop
from megarl.agents.tool_parsers import make_parser
from megarl.agents.tools.config import load_tools
from megarl.batch import MULTI_MODAL_COLUMN, Batch
from megarl.config.agents import OpenAIAgentConfig
from megarl.config.rollout import RolloutConfig, SamplingConfig
from megarl.config.root import MegarlConfig
from megarl.data.images import ImageProcessor
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.rewards.sources import Trajectory
from megarl.scoring.pipeline import RewardPipeline, RewardSettings, RowScore
from megarl.scoring.teacher import TeacherEngines, TeacherScorer


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
    routing: RoutingLayout | None = None
    """Ask the engines for each token's routed experts, laid out by this (`actor.router_replay=R3`); training
    rollouts only."""
    rewards: RewardSettings | None = None
    """How trajectories are scored; None = not scored (rollouts without scoring columns)."""
    teacher: TeacherEngines | None = None
    """The distillation teacher's engines (backend=engine): each training trajectory's `teacher_log_probs`."""
    openai: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)
    """agents.openai: the user agent rows with agent loop `openai` run, and its session server."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig, rewards: RewardSettings | None = None) -> "AgentSettings":
        """rollout.*, the model's tokenizer and data.max_prompt_length / max_response_length; aborted requests are
        resumed when asynchronous training pauses the engines in abort mode."""
        rewards = rewards or RewardSettings(reward=cfg.reward, models=cfg.reward_model)
        return cls(
            rollout=cfg.rollout,
            tokenizer_path=cfg.model.tokenizer_path or cfg.model.path,
            prompt_length=cfg.data.max_prompt_length,
            response_length=cfg.data.max_response_length,
            chat_template_kwargs=dict(cfg.data.chat_template_kwargs),
            resume_aborted=cfg.trainer.driver == "fully_async" and cfg.async_training.pause_mode == "abort",
            routing=RoutingLayout.of(cfg.model.path) if cfg.actor.router_replay == "R3" else None,
            rewards=rewards,
            teacher=teacher_engines(cfg, rewards),
            openai=cfg.agents.openai,
        )


def teacher_engines(cfg: MegarlConfig, rewards: RewardSettings) -> TeacherEngines | None:
    """The engine teacher's replicas when distillation runs on engines (launched: `rewards.teacher_urls`)."""
    distill = cfg.algorithm.distillation
    t = distill.teacher
    if not (cfg.trainer.mode == "rl" and distill.enable and t.backend == "engine"):
        return None
    urls = rewards.teacher_urls or t.engines.urls
    return TeacherEngines(urls=urls, keys=rewards.teacher_keys, retry=t.retry, concurrency=t.concurrency)


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
            prompt_length=settings.prompt_length,
            openai=settings.openai,
            reward_function=settings.rewards is not None and settings.rewards.reward.function is not None,
            images=ImageProcessor.of(tokenizer, settings.tokenizer_path),
        )
        self._loops: dict[str, AgentLoop] = {}
        self.rewards = RewardPipeline(settings.rewards) if settings.rewards is not None else None
        self.overlap = settings.rewards is not None and settings.rewards.reward.overlap
        self.teacher = TeacherScorer(settings.teacher) if settings.teacher is not None else None

    async def rollout_rows(self, rows: Batch, validate: bool, seed: int | None, first_row: int) -> tuple[Batch, float]:
        """Roll out and score every row concurrently; row i samples with seed `seed + 1000 * (first_row + i)`
        (+ turn). Training rollouts under R3 ask the engines for routed experts, validation never does."""
        started = time.perf_counter()
        sampling = sampling_for(self.settings.rollout, validate)
        routed = self.settings.routing is not None and not validate
        samples = [
            row_sample(rows, i, None if seed is None else seed + 1000 * (first_row + i), routed)
            for i in range(len(rows))
        ]
        names = rows["agent_name"] if "agent_name" in rows else [self.settings.rollout.default_agent] * len(rows)
        pairs = enumerate(zip(names, samples, strict=True))
        runs = [self._run(name, sample, sampling, rows, i, validate) for i, (name, sample) in pairs]
        finished = await asyncio.gather(*runs)
        outputs = [out for out, _, _ in finished]
        scores = [row for _, row, _ in finished]
        if self.rewards is not None and not self.overlap:
            scores = await asyncio.gather(
                *(self._score(rows, i, s, o) for i, (s, o) in enumerate(zip(samples, outputs, strict=True)))
            )
        settings = self.settings
        batch = to_batch(outputs, settings.prompt_length, settings.response_length, self.pad_token_id, settings.routing)
        batch.set("response_text", response_texts(outputs, self._context.chat.tokenizer))
        if any(sample.images is not None for sample in samples):
            batch.set(MULTI_MODAL_COLUMN, [sample.images.inputs if sample.images else None for sample in samples])
        if self.rewards is not None:
            self._record_scores(batch, rows, outputs, [row for row in scores if row is not None])
        if self.teacher is not None and not validate:
            batch.set(
                "teacher_log_probs", padded([teacher for _, _, teacher in finished], self.settings.response_length)
            )
        return batch, time.perf_counter() - started

    async def _run(
        self, name: str, sample: AgentSample, sampling: SamplingParams, rows: Batch, i: int, validate: bool
    ) -> tuple[AgentOutput, RowScore | None, list[float]]:
        """Row `i`'s trajectory, then at once its score (under `reward.overlap`) and, in training rollouts with an
        engine teacher, the teacher's log-probs of its response tokens."""
        out = await self._loop(name).run(sample, sampling)
        score = self._score(rows, i, sample, out) if self.overlap else _nothing()
        teacher = self.teacher.log_probs(out.prompt_ids, out.response_ids) if self.teacher and not validate else _none()
        row, log_probs = await asyncio.gather(score, teacher)
        return out, row, log_probs

    async def _score(self, rows: Batch, i: int, sample: AgentSample, out: AgentOutput) -> RowScore:
        assert self.rewards is not None
        return await self.rewards.score(self._trajectory(rows, i, out, sample.sample_id), out.reward, out.reward_extra)

    def _record_scores(self, batch: Batch, rows: Batch, outputs: list[AgentOutput], scores: list[RowScore]) -> None:
        """The scoring columns of a rollout batch (what `megarl.rewards.score.Scored.of_rollout` reads), and the RM's
        token ids when a Megatron RM scores after rollout."""
        assert self.rewards is not None
        batch.set("scores", torch.tensor([row.score for row in scores], dtype=torch.float32))
        batch.set("reward_extra", [row.extra for row in scores])
        batch.set("reward_answer", [row.answer for row in scores])
        batch.set("reward_stats", [row.stats for row in scores])
        if self.rewards.rm_on_trainer:
            trajectories = [self._trajectory(rows, i, out, "") for i, out in enumerate(outputs)]
            batch.set("rm_token_ids", [self.rewards.rm_token_ids(t) for t in trajectories])

    def _trajectory(self, rows: Batch, i: int, out: AgentOutput, sample_id: str) -> Trajectory:
        """What the reward sources see of row `i`'s finished trajectory `out` (`sample_id`: the agent sample's)."""
        truth = (rows["reward_model"][i] or {}).get("ground_truth", "") if "reward_model" in rows else ""
        extra = (rows["extra_info"][i] if "extra_info" in rows else None) or {}
        return Trajectory(
            data_source=str(rows["data_source"][i]) if "data_source" in rows else "",
            messages=out.messages,
            prompt_messages=list(rows["raw_prompt"][i]) if "raw_prompt" in rows else [],
            response_text=self._context.chat.tokenizer.decode(out.response_ids, skip_special_tokens=True),
            ground_truth=str(truth),
            extra_info=extra,
            sample_id=sample_id,
        )

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
        """Wait for the adapter unloads under way, close the router's and the reward sources' HTTP sessions and the
        reward processes."""
        for loop in self._loops.values():
            await loop.close()
        await self._context.router.close()
        if self.rewards is not None:
            await self.rewards.close()
        if self.teacher is not None:
            await self.teacher.close()


async def _nothing() -> None:
    return None


async def _none() -> list[float]:
    return []


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    """`[len(rows), width]` float32, each row's values from the left, zeros after."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def row_sample(rows: Batch, i: int, seed: int | None, routed_experts: bool = False) -> AgentSample:
    """Row `i` of a prompt batch (collate_prompts' columns) as an agent-loop sample with a fresh id; `routed_experts`:
    its requests ask for the experts each token was routed to."""
    extra = rows["extra_info"][i] if "extra_info" in rows else {}
    extra = extra or {}
    truth = (rows["reward_model"][i] or {}).get("ground_truth") if "reward_model" in rows else None
    source = str(rows["data_source"][i]) if "data_source" in rows else ""
    return AgentSample(
        sample_id=uuid.uuid4().hex,
        prompt_ids=list(rows["raw_prompt_ids"][i]),
        messages=list(rows["raw_prompt"][i]) if "raw_prompt" in rows else [],
        tools_kwargs=(rows["tools_kwargs"][i] if "tools_kwargs" in rows else None) or {},
        interaction_kwargs=extra.get("interaction_kwargs"),
        seed=seed,
        info={"data_source": source, "ground_truth": truth, "extra_info": extra},
        routed_experts=routed_experts,
        images=_prompt_images(rows, i),
    )


def _prompt_images(rows: Batch, i: int) -> TrajectoryImages | None:
    """Row `i`'s images (the dataset's `images` and `multi_modal_inputs`), None for a text row."""
    raw = rows["images"][i] if "images" in rows else None
    if raw is None or len(raw) == 0:
        return None
    inputs = rows[MULTI_MODAL_COLUMN][i]
    return TrajectoryImages(encoded=[to_base64(image) for image in raw], inputs=dict(inputs))
