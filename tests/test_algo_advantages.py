"""Advantage estimators: values computed by hand on tiny tensors, and properties on random ones."""

import math

import pytest
import torch

from megarl.algo import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    discounted_advantages,
    group_ids_from_uids,
    token_rewards_from_scores,
)
from megarl.config import AlgorithmConfig


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _outcome_inputs(scores: list[float], masks: list[list[float]], groups: list[int]) -> AdvantageInputs:
    mask = _t(masks)
    return AdvantageInputs(
        token_rewards=token_rewards_from_scores(torch.tensor(scores), mask),
        response_mask=mask,
        group_ids=torch.tensor(groups),
    )


def _run(name: str, inputs: AdvantageInputs, **cfg: object) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_advantages(inputs, AlgorithmConfig(adv_estimator=name, **cfg))  # type: ignore[arg-type]


def test_token_rewards_sit_on_the_last_model_token() -> None:
    mask = _t([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    rewards = token_rewards_from_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert torch.equal(rewards, _t([[0, 1, 0], [0, 0, 0], [0, 0, 3]]))


def test_group_ids_from_uids_in_first_seen_order() -> None:
    assert group_ids_from_uids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_gae_by_hand() -> None:
    adv, ret = discounted_advantages(_t([[0, 0, 1]]), _t([[0.5, 0.6, 0.7]]), _t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    # δ2 = 1 − 0.7 = 0.3; δ1 = 0.9·0.7 − 0.6 = 0.03, A1 = 0.03 + 0.72·0.3
    # δ0 = 0.9·0.6 − 0.5 = 0.04, A0 = 0.04 + 0.72·A1
    torch.testing.assert_close(adv, _t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, _t([[0.71712, 0.846, 1.0]]))


def test_gae_skips_tool_tokens_and_bootstraps_across_them() -> None:
    # A model token, a two-token tool response (values there are garbage), a model token with the reward.
    adv, ret = discounted_advantages(
        _t([[0, 0, 0, 1]]), _t([[0.5, 9.0, 9.0, 0.7]]), _t([[1, 0, 0, 1]]), gamma=0.9, lam=0.8
    )
    # Same as the two model tokens alone: A1 = 0.3, A0 = 0.9·0.7 − 0.5 + 0.72·0.3 = 0.346.
    torch.testing.assert_close(adv, _t([[0.346, 0, 0, 0.3]]))
    torch.testing.assert_close(ret, _t([[0.846, 0, 0, 1.0]]))


def test_reward_on_a_masked_position_counts_for_the_preceding_model_token() -> None:
    adv, _ = discounted_advantages(_t([[0, 0, 1]]), _t([[0.5, 0.6, 9.0]]), _t([[1, 1, 0]]), gamma=0.9, lam=0.8)
    # As if the reward sat on token 1: A1 = 1 − 0.6 = 0.4, A0 = 0.9·0.6 − 0.5 + 0.72·0.4 = 0.328.
    torch.testing.assert_close(adv, _t([[0.328, 0.4, 0]]))


def test_gae_estimator_whitens_advantages_and_keeps_raw_returns() -> None:
    inputs = AdvantageInputs(
        token_rewards=_t([[0, 0, 1]]),
        response_mask=_t([[1, 1, 1]]),
        group_ids=torch.tensor([0]),
        values=_t([[0.5, 0.6, 0.7]]),
    )
    adv, ret = _run("gae", inputs, gamma=1.0, lam=1.0)
    raw = torch.tensor([0.5, 0.4, 0.3])
    torch.testing.assert_close(adv[0], (raw - raw.mean()) / (raw.var() + 1e-6).sqrt())
    torch.testing.assert_close(ret, _t([[1, 1, 1]]))


def test_gae_without_values_names_the_fix() -> None:
    with pytest.raises(ValueError, match="needs critic values"):
        _run("gae", _outcome_inputs([1.0], [[1]], [0]))


GROUPED = ([1.0, 0.0, 1.0, 0.5], [[1, 1], [1, 0], [1, 1], [1, 1]], [0, 0, 0, 1])
"""Scores, masks and group ids: a group of three and a group of one."""


def test_grpo_by_hand() -> None:
    adv, ret = _run("grpo", _outcome_inputs(*GROUPED))
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1]
    a, b = (1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6)
    torch.testing.assert_close(adv, _t([[a, a], [b, 0], [a, a], [0, 0]]))
    assert torch.equal(adv, ret)


def test_dr_grpo_drops_the_std() -> None:
    adv, _ = _run("grpo", _outcome_inputs(*GROUPED), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, _t([[1 / 3, 1 / 3], [-2 / 3, 0], [1 / 3, 1 / 3], [0, 0]]))


def test_grpo_passk_only_the_best_learns() -> None:
    inputs = _outcome_inputs([1.0, 0.0, 0.5, 0.2, 0.2], [[1]] * 5, [0, 0, 0, 1, 1])
    adv, _ = _run("grpo_passk", inputs, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, _t([[0.5], [0], [0], [0], [0]]))  # best − second best; a tie gives 0
    adv, _ = _run("grpo_passk", inputs)
    torch.testing.assert_close(adv[0, 0], torch.tensor(0.5 / (0.5 + 1e-6)))  # std of [1, 0, 0.5] is 0.5


def test_rloo_by_hand() -> None:
    adv, _ = _run("rloo", _outcome_inputs(*GROUPED))
    # s_i − mean of the others: 1 − 0.5, 0 − 1, 1 − 0.5; a group of one gets 0.
    torch.testing.assert_close(adv, _t([[0.5, 0.5], [-1, 0], [0.5, 0.5], [0, 0]]))


def test_opo_uses_a_length_weighted_baseline() -> None:
    adv, _ = _run("opo", _outcome_inputs([1.0, 0.0], [[1, 0, 0], [1, 1, 1]], [0, 0]))
    # b = (1·1 + 3·0) / 4 = 0.25
    torch.testing.assert_close(adv, _t([[0.75, 0, 0], [-0.25, -0.25, -0.25]]))


def test_reinforce_plus_plus_by_hand() -> None:
    inputs = AdvantageInputs(
        token_rewards=_t([[0, 1], [0, 0]]), response_mask=_t([[1, 1], [1, 0]]), group_ids=torch.tensor([0, 1])
    )
    adv, ret = _run("reinforce_plus_plus", inputs, gamma=0.5)
    torch.testing.assert_close(ret, _t([[0.5, 1], [0, 0]]))
    # whitened over {0.5, 1, 0}: mean 0.5, unbiased std 0.5
    torch.testing.assert_close(adv, _t([[0, 1], [-1, 0]]), atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    adv, _ = _run("reinforce_plus_plus_baseline", _outcome_inputs([1.0, 0.0], [[1], [1]], [0, 0]))
    # centred [0.5, −0.5], whitened over two tokens: unbiased std sqrt(0.5)
    torch.testing.assert_close(adv, _t([[0.5 / math.sqrt(0.5)], [-0.5 / math.sqrt(0.5)]]), atol=1e-5, rtol=0)


def test_remax_subtracts_the_greedy_reward() -> None:
    inputs = AdvantageInputs(
        token_rewards=_t([[0, 1]]),
        response_mask=_t([[1, 1]]),
        group_ids=torch.tensor([0]),
        baseline_scores=torch.tensor([0.25]),
    )
    adv, ret = _run("remax", inputs)
    torch.testing.assert_close(adv, _t([[0.75, 0.75]]))
    torch.testing.assert_close(ret, _t([[1, 1]]))
    with pytest.raises(ValueError, match="greedy baseline"):
        _run("remax", _outcome_inputs([1.0], [[1]], [0]))


def _random_batch(seed: int, num_groups: int = 4, group_size: int = 3, length: int = 7) -> AdvantageInputs:
    gen = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    mask = (torch.rand(b, length, generator=gen) > 0.3).float()
    mask[0] = 0  # an empty response
    rewards = torch.randn(b, length, generator=gen) * mask
    return AdvantageInputs(
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.arange(num_groups).repeat_interleave(group_size)[torch.randperm(b, generator=gen)],
        values=torch.randn(b, length, generator=gen),
        baseline_scores=torch.randn(b, generator=gen),
    )


@pytest.mark.parametrize("seed", range(5))
def test_gae_with_unit_gamma_lam_is_reward_to_go_minus_values(seed: int) -> None:
    batch = _random_batch(seed)
    assert batch.values is not None
    adv, ret = discounted_advantages(batch.token_rewards, batch.values, batch.response_mask, gamma=1.0, lam=1.0)
    to_go = batch.token_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret, to_go * batch.response_mask)
    torch.testing.assert_close(adv, (to_go - batch.values) * batch.response_mask)


@pytest.mark.parametrize("seed", range(5))
def test_gae_equals_gae_on_the_model_tokens_alone(seed: int) -> None:
    batch = _random_batch(seed)
    assert batch.values is not None
    adv, _ = discounted_advantages(batch.token_rewards, batch.values, batch.response_mask, gamma=0.95, lam=0.9)
    for row in range(len(adv)):
        keep = batch.response_mask[row].bool()
        compact, _ = discounted_advantages(
            batch.token_rewards[row, keep][None],
            batch.values[row, keep][None],
            torch.ones(1, int(keep.sum())),
            gamma=0.95,
            lam=0.9,
        )
        torch.testing.assert_close(adv[row, keep], compact[0])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("seed", range(3))
def test_group_advantages_sum_to_zero_within_each_group(name: str, seed: int) -> None:
    batch = _random_batch(seed)
    batch = AdvantageInputs(
        token_rewards=batch.token_rewards, response_mask=torch.ones_like(batch.response_mask), group_ids=batch.group_ids
    )
    adv, _ = _run(name, batch)
    per_seq = adv[:, 0]
    if name == "reinforce_plus_plus_baseline":  # whitening rescales and re-centres the whole batch
        per_seq = per_seq - per_seq.mean()
    for group in batch.group_ids.unique():
        assert abs(float(per_seq[batch.group_ids == group].sum())) < 1e-4


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_finite_and_zero_off_the_mask(name: str) -> None:
    batch = _random_batch(0, num_groups=3, group_size=1)  # groups of one, and an all-masked row
    adv, ret = _run(name, batch, gamma=0.9, lam=0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    off = batch.response_mask == 0
    assert (adv[off] == 0).all() and (ret[off] == 0).all()
    assert (adv[0] == 0).all()
