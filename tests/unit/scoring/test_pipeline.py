"""The reward pipeline an agent worker scores with (megarl/scoring/pipeline.py), rule part: a row's reward function
by data_source (in a thread, and in the process pool), the agent loop's own reward, answers and numeric extras, the
weight of the rule component; and what the trainer reads of the scored rows (`Scored.of_rollout`: metrics, skips,
GDPO's components)."""

import asyncio

import pytest
import torch

from megarl.batch import Batch
from megarl.config.reward import RewardModelConfig
from megarl.config.trainer import RewardConfig
from megarl.rewards.score import Scored, reward_components
from megarl.rewards.sources import Trajectory
from megarl.scoring.pipeline import RewardPipeline, RewardSettings, RowScore


def _trajectory(text: str) -> Trajectory:
    prompt = [{"role": "user", "content": "q"}]
    return Trajectory(
        data_source="openai/gsm8k",
        messages=[*prompt, {"role": "assistant", "content": text}],
        prompt_messages=prompt,
        response_text=text,
        ground_truth="72",
    )


def _score(num_workers: int, rule_weight: float = 1.0) -> list[RowScore]:
    settings = RewardSettings(
        reward=RewardConfig(num_workers=num_workers), models=RewardModelConfig(rule_weight=rule_weight)
    )

    async def run() -> list[RowScore]:
        pipeline = RewardPipeline(settings)
        try:
            texts = [("so #### 72", None), ("maybe 5", None), ("tool said so", 0.5)]
            return list(await asyncio.gather(*(pipeline.score(_trajectory(t), r) for t, r in texts)))
        finally:
            await pipeline.close()

    return asyncio.run(run())


@pytest.mark.parametrize("num_workers", [0, 1])
def test_rule_scores_answers_and_extras_in_a_thread_and_in_the_process_pool(num_workers: int) -> None:
    rows = _score(num_workers)
    assert [row.score for row in rows] == [1.0, 0.0, 0.5]
    assert [row.answer for row in rows] == ["72", None, None]  # strict: no `####` in the second
    assert [row.extra for row in rows] == [{"format_ok": 1.0, "acc": 1.0}, {"format_ok": 0.0, "acc": 0.0}, {}]
    assert all(row.stats["errors"] == row.stats["retries"] == row.stats["skipped"] == 0.0 for row in rows)
    assert all(row.stats["latency_s"] >= 0.0 for row in rows)


def test_a_loops_reward_components_become_the_rows_extras() -> None:
    """An `openai` agent's dict return: its `score` is the reward, the other components the row's extras (GDPO)."""

    async def run() -> RowScore:
        pipeline = RewardPipeline(RewardSettings(reward=RewardConfig(), models=RewardModelConfig()))
        try:
            return await pipeline.score(_trajectory("anything"), 0.5, {"format": 1.0, "turns": 2.0})
        finally:
            await pipeline.close()

    row = asyncio.run(run())
    assert (row.score, row.extra) == (0.5, {"format": 1.0, "turns": 2.0})


def test_rule_weight_scales_the_rule_component() -> None:
    assert [row.score for row in _score(0, rule_weight=0.5)] == [0.5, 0.0, 0.25]


def _rollout(scores: list[float], extras: list[dict[str, float]], skipped: list[float]) -> Batch:
    n = len(scores)
    return Batch.from_dict(
        {"scores": torch.tensor(scores), "response_mask": torch.ones(n, 3, dtype=torch.long)},
        {
            "uid": ["a", "a", "a", "b"][:n],
            "reward_extra": extras,
            "reward_stats": [
                {"latency_s": 0.1 * (i + 1), "retries": 1.0, "errors": s, "skipped": s} for i, s in enumerate(skipped)
            ],
        },
    )


def test_of_rollout_metrics_and_gdpo_components() -> None:
    extras = [{"acc": 1.0, "format_ok": 1.0}, {"acc": 0.0, "format_ok": 0.0}]
    scored = Scored.of_rollout(_rollout([1.0, 0.0], extras, [0.0, 0.0]))
    assert scored.metrics["reward/acc/mean"] == 0.5 and scored.metrics["reward/retries"] == 2.0
    assert scored.metrics["reward/errors"] == 0.0 and scored.metrics["reward/latency_p50"] == pytest.approx(0.15)
    components, weights = reward_components(scored.extras, {"acc": 1.0, "format_ok": 0.5})
    assert components.tolist() == [[1.0, 1.0], [0.0, 0.0]] and weights.tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match=r"names \['judge'\], but row 0's reward has extras"):
        reward_components(scored.extras, {"judge": 1.0})


def test_a_skipped_row_trains_nothing_and_takes_its_groups_mean() -> None:
    batch = _rollout([1.0, 0.0, 0.0, 0.5], [{}] * 4, [0.0, 0.0, 1.0, 1.0])
    scored = Scored.of_rollout(batch)
    assert scored.scores.tolist() == [1.0, 0.0, 0.5, 0.0]  # row 2: mean of rows 0-1; row 3: a group of skips only
    assert batch["response_mask"].sum(dim=1).tolist() == [3, 3, 0, 0]
    assert scored.metrics["reward/skipped"] == 2.0 and scored.metrics["reward/errors"] == 2.0


def test_a_component_scored_after_rollout_is_weighted_in_and_kept() -> None:
    scored = Scored.of_rollout(_rollout([1.0, 0.0], [{"rule": 1.0}, {"rule": 0.0}], [0.0, 0.0]))
    with_rm = scored.with_component("rm", torch.tensor([0.5, -1.0]), weight=2.0)
    assert with_rm.scores.tolist() == [2.0, -2.0]
    assert with_rm.extras == [{"rule": 1.0, "rm": 0.5}, {"rule": 0.0, "rm": -1.0}]
    assert with_rm.metrics["reward/rm/mean"] == -0.25
