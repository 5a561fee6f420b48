"""`RewardPipeline`: one agent worker's scoring of its trajectories, each as soon as its agent loop ends.

    pipeline = RewardPipeline(settings)
    row = await pipeline.score(trajectory, loop_reward)     # on the worker's event loop, beside running loops
    await pipeline.close()

Consumes: one finished `Trajectory` per `score` call (and the agent loop's own reward, if a tool or interaction
gave one). Runs every enabled source at once: the rule function in its process pool (`rules.RuleScorer`), the RM's
`/classify` replicas (`reward_model.discriminative.backend=server`), the judge's engines, the remote service — each
bounded by its own concurrency, each try within its `retry` limits. Waits for: those answers only; the event loop
keeps serving the other samples' loops meanwhile. A source that fails every try gets `reward_model.on_error`: fail
raises (the rollout, and so the step, fails naming the sample and source), default_score scores it
`default_score`, skip_sample marks the row skipped (the trainer zeroes its response mask: `Scored.of_rollout`).
Shuts down: `close()` waits for running rule calls and closes the sources' HTTP sessions.

The Megatron RM (`backend=megatron`) is not a source here: it scores a step's trajectories on the trainer's
devices after rollout; the pipeline gives each row the RM's token ids for it (`rm_token_ids`).
"""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from megarl.config.reward import RewardModelConfig
from megarl.config.trainer import RewardConfig
from megarl.engines.client.auth import EngineKeys
from megarl.rewards.sources import Component, RewardSource, RewardSourceError, Trajectory
from megarl.scoring.rules import RuleScorer


@dataclass(kw_only=True, slots=True)
class RewardSettings:
    """What an agent worker needs to score: the rule and model configs, and the reward engines' addresses."""

    reward: RewardConfig
    models: RewardModelConfig
    judge_urls: list[str] = field(default_factory=list)
    """The judge's replicas (launched, or `reward_model.generative.engines.urls`)."""
    judge_keys: EngineKeys | None = None
    """Their bearer keys (None or empty: the user's servers, no keys)."""
    classifier_urls: list[str] = field(default_factory=list)
    """The RM's `/classify` replicas (backend=server)."""
    classifier_keys: EngineKeys | None = None
    """Their bearer keys."""
    teacher_urls: list[str] = field(default_factory=list)
    """The distillation teacher's replicas (`algorithm.distillation.teacher.backend=engine`; `scoring.teacher`)."""
    teacher_keys: EngineKeys | None = None
    """Their bearer keys."""


@dataclass(frozen=True, slots=True)
class RowScore:
    score: float
    """Σ weight × component."""
    extra: dict[str, float]
    """The rule function's numeric extras, and with model rewards each component by name (`rule`, `rm`, `judge`,
    `remote`) and their own extras (`judge/parse_failures`)."""
    answer: str | None
    """The rule function's extracted answer (validation's maj@k)."""
    stats: dict[str, float]
    """latency_s, retries, errors (sources that failed every try), skipped (1.0 under on_error=skip_sample)."""


class RewardPipeline:
    def __init__(self, settings: RewardSettings) -> None:
        self.models = settings.models
        self.rules = RuleScorer(settings.reward)
        self.sources: list[tuple[RewardSource, float]] = model_sources(settings)
        self._rm_tokenizer: Any = None

    async def score(
        self, trajectory: Trajectory, loop_reward: float | None, loop_extra: dict[str, float] | None = None
    ) -> RowScore:
        """Every source's component of `trajectory`, combined by the weights (`loop_extra`: the loop reward's
        components)."""
        started = time.perf_counter()
        rule_score = self.rules.score(trajectory, loop_reward, loop_extra)
        rule, answers = await asyncio.gather(rule_score, self._components(trajectory))
        extra = numeric(rule.extra)
        score, stats = self.models.rule_weight * float(rule.score), {"retries": 0.0, "errors": 0.0, "skipped": 0.0}
        if self.sources or self.models.discriminative.enable:
            extra["rule"] = float(rule.score)
        for (source, weight), (component, error) in zip(self.sources, answers, strict=True):
            value = self._value(component, error, stats)
            score += weight * value
            extra |= {source.name: value} | {f"{source.name}/{k}": v for k, v in component.extra.items()}
        stats["latency_s"] = time.perf_counter() - started
        return RowScore(score=score, extra=extra, answer=rule.answer, stats=stats)

    async def _components(self, trajectory: Trajectory) -> list[tuple[Component, RewardSourceError | None]]:
        return list(await asyncio.gather(*(self._component(source, trajectory) for source, _ in self.sources)))

    async def _component(
        self, source: RewardSource, trajectory: Trajectory
    ) -> tuple[Component, RewardSourceError | None]:
        try:
            return await source.score(trajectory), None
        except RewardSourceError as error:
            if self.models.on_error == "fail":
                raise RuntimeError(
                    f"reward source {source.name!r} failed on sample {trajectory.sample_id} (data_source "
                    f"{trajectory.data_source!r}): {error}; reward_model.on_error=skip_sample or default_score go on"
                ) from error
            return Component(self.models.default_score), error

    def _value(self, component: Component, error: RewardSourceError | None, stats: dict[str, float]) -> float:
        """The component's value, counting its retries and its failure into `stats`."""
        stats["retries"] += component.retries if error is None else error.retries
        if error is not None:
            stats["errors"] += 1.0
            stats["skipped"] = float(self.models.on_error == "skip_sample")
        return component.value

    def rm_token_ids(self, trajectory: Trajectory) -> list[int]:
        """The conversation as the Megatron RM reads it: its own chat template and tokenizer, the last
        `max_length` tokens."""
        from megarl.rewards.formatting import rm_token_ids

        rm = self.models.discriminative
        if self._rm_tokenizer is None:
            from transformers import AutoTokenizer

            self._rm_tokenizer = AutoTokenizer.from_pretrained(rm.tokenizer_path or rm.path)
        return rm_token_ids(self._rm_tokenizer, trajectory.messages, rm.max_length, rm.chat_template_kwargs)

    @property
    def rm_on_trainer(self) -> bool:
        """A Megatron RM scores after rollout: rows carry `rm_token_ids`."""
        rm = self.models.discriminative
        return rm.enable and rm.backend == "megatron"

    async def close(self) -> None:
        self.rules.close()
        await asyncio.gather(*(source.close() for source, _ in self.sources))


def numeric(extra: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a reward function's extras (booleans as 0/1)."""
    return {key: float(value) for key, value in extra.items() if isinstance(value, int | float | bool)}


def model_sources(settings: RewardSettings) -> list[tuple[RewardSource, float]]:
    """The enabled sources that score on this worker, each with its weight."""
    models = settings.models
    sources: list[tuple[RewardSource, float]] = []
    rm, judge, remote = models.discriminative, models.generative, models.remote
    if rm.enable and rm.backend == "server":
        from megarl.scoring.classify import ClassifierSource

        sources.append((ClassifierSource(rm, settings.classifier_urls, settings.classifier_keys), rm.weight))
    if judge.enable:
        from megarl.scoring.judge import JudgeSource

        sources.append((JudgeSource(judge, settings.judge_urls, settings.judge_keys), judge.weight))
    if remote.url is not None:
        from megarl.scoring.remote import RemoteSource

        sources.append((RemoteSource(remote), remote.weight))
    return sources
