"""The pure pieces of asynchronous training: staleness arithmetic, the group buffer, admission, config checks."""

import threading
from dataclasses import replace

import pytest
import torch
from conftest import compose_config

from megarl.batch import Batch
from megarl.config import ConfigError
from megarl.plan.gate import validate
from megarl.rewards.score import Scored
from megarl.trainer import steps
from megarl.trainer.collect import round_seed
from megarl.trainer.drivers import group_buffer
from megarl.trainer.drivers import staleness as staleness_module
from megarl.trainer.drivers.group_buffer import Group, GroupBuffer, PromptGroup, taken_ages
from megarl.trainer.drivers.producer import admits, draw_groups, group_samples
from megarl.trainer.drivers.staleness import staleness, staleness_metrics, version_span

VERSIONS = torch.tensor(
    [
        [3, 3, 3, -1],  # all by v3
        [2, 2, 3, 3],  # a partial rollout: v2 then v3
        [-1, 1, -1, 1],  # tool tokens between v1 tokens
        [-1, -1, -1, -1],  # no model token
    ]
)


def test_staleness_is_current_minus_the_oldest_model_token() -> None:
    assert staleness(VERSIONS, current=3).tolist() == [0, 1, 2, 0]
    assert version_span(VERSIONS).tolist() == [0, 1, 0, 0]
    metrics = staleness_metrics(VERSIONS, current=3)
    assert metrics["async/staleness/mean"] == 0.75 and metrics["async/staleness/max"] == 2
    assert metrics["async/version_span/max"] == 1 and metrics["async/multi_version_frac"] == 0.25
    hist = [metrics[f"async/staleness/hist_{k}"] for k in ("0", "1", "2", "3+")]
    assert hist == [0.5, 0.25, 0.25, 0.0]
    assert staleness_metrics(VERSIONS, current=6)["async/staleness/hist_3+"] == 0.75  # the empty row is 0


def test_staleness_is_computed_once_per_taken_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The freshness check (`Group.age_at`) and the step's metrics share one computation per group."""
    groups = [replace(_group(i), batch=Batch.from_dict({"rollout_versions": VERSIONS[i : i + 2]})) for i in (0, 2)]
    calls: list[int] = []

    def counted(versions: torch.Tensor, current: int) -> torch.Tensor:
        calls.append(len(versions))
        return staleness(versions, current)

    monkeypatch.setattr(group_buffer, "staleness", counted)
    monkeypatch.setattr(staleness_module, "staleness", counted)
    fresh = [int(group.age_at(3).max()) <= 1 for group in groups]
    metrics = staleness_metrics(VERSIONS, current=3, ages=taken_ages(groups))
    assert fresh == [True, False]
    assert calls == [2, 2]  # once per group (its 2 rows); not again for the metrics
    assert metrics == staleness_metrics(VERSIONS, current=3)  # what recomputing from the batch gives


def test_the_producer_builds_each_uid_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups carry the uid the synchronous trainer gives their prompt; their samples get it in one write."""
    prompts = Batch.from_dict(
        {"input_ids": torch.ones(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3), "x": torch.arange(4)},
        {"raw_prompt": [f"p{i}" for i in range(4)]},
    )
    groups = draw_groups(prompts, first_index=8, batch_size=4, n=3, seed=7)
    assert [(g.index, g.uid, g.seed, g.first_row) for g in groups] == [
        (8 + i, f"3.1:{i}", round_seed(7, 3, 1), 3 * i) for i in range(4)
    ]
    uid_writes: list[object] = []
    set_column = Batch.set

    def counted(batch: Batch, key: str, value: object) -> None:
        uid_writes.extend([value] if key == "uid" else [])
        set_column(batch, key, value)

    monkeypatch.setattr(Batch, "set", counted)
    samples = [group_samples(group, 3) for group in groups]
    assert len(uid_writes) == len(groups)  # one write per group: no placeholder uid overwritten
    monkeypatch.undo()
    synchronous = steps.samples_of(prompts, 3, "3.1")  # the uids `collect` gives step 3's first round
    assert [str(u) for s in samples for u in s["uid"]] == [str(u) for u in synchronous["uid"]]
    assert set(samples[0].tensor_keys) == {"x"} and list(samples[1]["raw_prompt"]) == ["p1"] * 3
    assert "uid" not in groups[0].prompt.non_tensor_keys  # the group's own prompt is left as drawn


def _group(index: int) -> Group:
    prompt = Batch.from_dict({"x": torch.tensor([[index]])})
    source = PromptGroup(index=index, prompt=prompt, uid=f"1.1:{index}", seed=0, first_row=0)
    return Group(source=source, batch=prompt, scored=Scored(torch.tensor([0.0]), {}, [{}]))


def test_buffer_hands_out_the_lowest_numbered_groups_once_enough_are_there() -> None:
    buffer = GroupBuffer()
    taken: list[list[int]] = []
    waiter = threading.Thread(target=lambda: taken.append([g.source.index for g in buffer.take(2) or []]))
    waiter.start()
    buffer.put(_group(5))
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # one group is not two
    buffer.put(_group(3))
    waiter.join(timeout=5)
    assert taken == [[3, 5]]
    buffer.put(_group(6))
    buffer.put(_group(4))
    assert [g.index for g in buffer.snapshot()] == [4, 6]
    assert [g.source.index for g in buffer.take(1) or []] == [4]
    with pytest.raises(AssertionError, match="buffered twice"):
        buffer.put(_group(6))
    buffer.close()
    assert buffer.take(1) is None


def test_admission_keeps_the_producer_within_max_staleness_steps_of_the_engines() -> None:
    batch = 4
    # on-policy: only the current step's groups (engines at v2 roll out step 3, groups 8..11)
    assert [i for i in range(20) if admits(i, batch, engine_version=2, max_staleness=0)] == list(range(12))
    assert not admits(12, batch, engine_version=2, max_staleness=0)
    assert admits(15, batch, engine_version=2, max_staleness=1) and not admits(16, batch, 2, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.driver=sometimes"], "trainer.driver='sometimes' is unknown"),
        (["trainer.driver=fully_async"], "set trainer.placement=separate"),
        (["async_training.max_staleness=-1"], "async_training.max_staleness=-1 must be >= 0"),
        (["async_training.buffer_groups=1"], "buffer_groups=1 is smaller than one batch"),
        (["async_training.pause_mode=drain"], "async_training.pause_mode='drain' is unknown"),
        (["async_training.stale_policy=keep"], "async_training.stale_policy='keep' is unknown"),
        (
            ["trainer.driver=fully_async", "async_training.sync_every=3"],
            "async_training.sync_every=3 with max_staleness=1",
        ),
        (["trainer.driver=fully_async", "algorithm.filter_groups.enable=true"], "dynamic sampling"),
        (["trainer.driver=fully_async", "algorithm.adv_estimator=remax"], "greedy baselines"),
        (["trainer.driver=one_step_off"], "set trainer.placement=separate"),
    ],
)
def test_async_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    cfg = compose_config("trainer=cpu", "data.train_batch_size=4", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_files=False)
    assert message in str(err.value)
