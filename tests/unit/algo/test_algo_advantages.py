"""Advantage estimators: values computed by hand on tiny tensors, and properties on random ones."""

import dataclasses
import math

import pytest
import torch

from megarl.algo import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    discounted_advantages,
    estimator_traits,
    group_ids_from_uids,
    register_advantage_estimator,
    token_rewards_from_scores,
)
from megarl.algo.estimators_otb import sum_pi_squared_from_logits
from megarl.config import AlgorithmConfig
from megarl.config.algorithm import RolloutCorrectionConfig


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


@pytest.mark.parametrize("fill", [math.nan, math.inf])
def test_gae_never_reads_values_off_the_mask(fill: float) -> None:
    adv, ret = discounted_advantages(
        _t([[0, 0, 0, 1, 0]]), _t([[0.5, fill, fill, 0.7, fill]]), _t([[1, 0, 0, 1, 0]]), gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(adv, _t([[0.346, 0, 0, 0.3, 0]]))  # as with finite garbage values
    torch.testing.assert_close(ret, _t([[0.846, 0, 0, 1.0, 0]]))


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


def _random_batch(
    seed: int, num_groups: int = 4, group_size: int = 3, length: int = 7, padding: float = 0.0
) -> AdvantageInputs:
    """Random inputs with `padding` (e.g. NaN) in every per-token input except the rewards off the mask."""
    gen = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    mask = (torch.rand(b, length, generator=gen) > 0.3).float()
    mask[0] = 0  # an empty response
    rewards = torch.randn(b, length, generator=gen) * mask
    logits = torch.randn(b, length, 5, generator=gen)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask.bool(), x, padding)

    return AdvantageInputs(
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.arange(num_groups).repeat_interleave(group_size)[torch.randperm(b, generator=gen)],
        values=pad(torch.randn(b, length, generator=gen)),
        baseline_scores=torch.randn(b, generator=gen),
        reward_components=torch.randint(0, 2, (b, 2), generator=gen).float(),
        old_log_probs=pad(torch.log_softmax(logits, dim=-1)[..., 0]),
        sum_pi_squared=pad(sum_pi_squared_from_logits(logits)),
        rollout_log_probs=pad(torch.log_softmax(logits * 1.1, dim=-1)[..., 0]),
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


@pytest.mark.parametrize("padding", [0.0, math.nan, math.inf])
@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_finite_and_zero_off_the_mask(name: str, padding: float) -> None:
    for batch in (_random_batch(0, 3, 1, padding=padding), _random_batch(1, 2, 3, padding=padding)):
        adv, ret = _run(name, batch, gamma=0.9, lam=0.95, rollout_is_cap=2.0)  # groups of one and of three
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        off = batch.response_mask == 0
        assert (adv[off] == 0).all() and (ret[off] == 0).all()
        assert (adv[0] == 0).all()  # an all-masked row


def test_gpg_by_hand() -> None:
    scores = [1.0, 0.0, 1.0, 0.5, 0.5, 2.0]  # a varied group of three, a uniform pair, a group of one
    inputs = _outcome_inputs(scores, [[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]], [0, 0, 0, 1, 1, 2])
    adv, ret = _run("gpg", inputs)
    # α = B / B_valid = 6 / 3; A = α·(s − 2/3) in the varied group, 0 elsewhere
    a, b = 2 * (1 - 2 / 3), 2 * (0 - 2 / 3)
    torch.testing.assert_close(adv, _t([[a, a], [b, 0], [a, a], [0, 0], [0, 0], [0, 0]]))
    assert torch.equal(adv, ret)
    adv, _ = _run("gpg", _outcome_inputs([1.0, 1.0], [[1], [1]], [0, 0]))
    assert (adv == 0).all()  # no valid sample at all: no advantage, no division by zero


def _components(components: list[list[float]], weights: list[float] | None) -> AdvantageInputs:
    return AdvantageInputs(
        token_rewards=torch.zeros(len(components), 1),
        response_mask=torch.ones(len(components), 1),
        group_ids=torch.tensor([0, 0, 1, 1]),
        reward_components=_t(components),
        reward_weights=None if weights is None else torch.tensor(weights),
    )


def test_gdpo_by_hand() -> None:
    components = [[1, 1], [1, 0], [0, 1], [1, 0]]  # (format, accuracy) of two groups of two
    # centred per component: format [0, 0, −½, ½], accuracy [½, −½, ½, −½]; with weights (1, 2):
    combined = torch.tensor([1.0, -1.0, 0.5, -0.5])
    whitened = combined / math.sqrt(float(combined.var()) + 1e-6)  # batch mean is 0 already
    adv, ret = _run("gdpo", _components(components, [1.0, 2.0]), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], whitened)
    assert torch.equal(adv, ret)
    # Dividing each component by its group std (√½ in every varied group) scales all by the same factor.
    adv, _ = _run("gdpo", _components(components, [1.0, 2.0]))
    torch.testing.assert_close(adv[:, 0], whitened, atol=1e-4, rtol=0)
    # Unweighted: combined = [½, −½, 0, 0]
    adv, _ = _run("gdpo", _components(components, None), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0, 0]) / math.sqrt(1 / 6 + 1e-6))


def test_gdpo_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="reward components"):
        _run("gdpo", _outcome_inputs([1.0, 0.0], [[1], [1]], [0, 0]))
    with pytest.raises(ValueError, match="3 reward weights for 2 reward components"):
        _run("gdpo", _components([[1, 1], [1, 0], [0, 1], [1, 0]], [1.0, 1.0, 1.0]))


NAN = math.nan


def _otb_inputs(pi: list[list[float]], sum_sq: list[list[float]], rewards: list[list[float]]) -> AdvantageInputs:
    """Group 0: rows 0–2, group 1: row 3 alone; the mask is where π is not NaN."""
    mask = ~torch.isnan(_t(pi))
    return AdvantageInputs(
        token_rewards=_t(rewards),
        response_mask=mask.float(),
        group_ids=torch.tensor([0, 0, 0, 1]),
        old_log_probs=_t(pi).log(),
        sum_pi_squared=_t(sum_sq),
    )


SINGLE_TURN = _otb_inputs(
    pi=[[0.5, 0.1, NAN], [0.25, 0.25, NAN], [0.25, 0.25, 0.25], [0.5, 0.5, NAN]],
    sum_sq=[[0.5, 0.7, NAN], [0.5, 0.5, NAN], [0.5, 0.5, 0.5], [0.5, 0.5, NAN]],
    rewards=[[0, 1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]],
)
"""w = 1 − 2π + Σπ² per token: row 0 [0.5, 1.5], row 1 [1, 1], row 2 [1, 1, 1], row 3 [0.5, 0.5]."""

MULTI_TURN = _otb_inputs(
    pi=[
        [0.5, 0.1, NAN, NAN, NAN],
        [0.25, 0.25, NAN, NAN, NAN],
        [0.25, NAN, NAN, 0.25, 0.25],
        [0.5, 0.5, NAN, NAN, NAN],
    ],
    sum_sq=[[0.5, 0.7, NAN, NAN, NAN], [0.5, 0.5, NAN, NAN, NAN], [0.5, NAN, NAN, 0.5, 0.5], [0.5, 0.5, NAN, NAN, NAN]],
    rewards=[[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 1, 0, 0, 0]],
)
"""SINGLE_TURN with a two-token tool block after row 2's first model token."""

OTB_EXPECTED = _t([[0.4, 1 / 3, 0], [-0.6, -2 / 3, 0], [0.4, 1 / 3, 1], [1, 1, 0]])
"""W: row 0 [0.5, 2], row 1 [1, 2], row 2 [1, 2, 3]; G: rows 0, 2, 3 score 1, row 1 scores 0.
B_0 = (1·0.5 + 0·1 + 1·1) / 2.5 = 0.6, B_1 = (1·2 + 0·2 + 1·2) / 6 = 2/3; B_2 = 0 (only row 2 is
alive: the zero tail) and row 3, alone in its group, has B = 0, so A = G there."""


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_by_hand(name: str) -> None:
    adv, ret = _run(name, SINGLE_TURN)
    torch.testing.assert_close(adv, OTB_EXPECTED)
    torch.testing.assert_close(ret, _t([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 1, 0]]))


def test_multi_turn_otb_aligns_by_model_token_and_skips_tool_blocks() -> None:
    adv, _ = _run("tir_optimal_token_baseline", MULTI_TURN)
    for row in range(4):  # each row's model tokens get the advantages of the batch without the tool block
        keep = MULTI_TURN.response_mask[row].bool()
        torch.testing.assert_close(adv[row, keep], OTB_EXPECTED[row, : int(keep.sum())])
        assert (adv[row, ~keep] == 0).all()
    single, _ = _run("optimal_token_baseline", MULTI_TURN)  # aligned by position: row 2's tokens 3, 4 alone
    torch.testing.assert_close(single[2], _t([1 - 0.6, 0, 0, 1, 1]))


def test_otb_scales_the_energy_by_the_squared_is_ratio() -> None:
    assert SINGLE_TURN.old_log_probs is not None
    rollout = SINGLE_TURN.old_log_probs.clone()
    rollout[1] -= math.log(2.0)  # ρ = 2 on row 1: its w becomes 4, so W = [4, 8]
    inputs = dataclasses.replace(SINGLE_TURN, rollout_log_probs=rollout)
    adv, _ = _run("optimal_token_baseline", inputs, rollout_is_cap=3.0)
    b0, b1 = (1 * 0.5 + 1 * 1) / (0.5 + 4 + 1), (1 * 2 + 1 * 2) / (2 + 8 + 2)
    torch.testing.assert_close(adv[:3, :2], _t([[1 - b0, 1 - b1], [-b0, -b1], [1 - b0, 1 - b1]]))
    with pytest.raises(ValueError, match="no old or rollout log-probs"):
        _run("optimal_token_baseline", SINGLE_TURN, rollout_is_cap=3.0)


def test_otb_takes_the_weights_of_any_rollout_correction() -> None:
    """Masked IS (MIS) with upper 1.5 rejects row 1 (ρ = 2): its w is 0, so its energy leaves the baseline."""
    assert SINGLE_TURN.old_log_probs is not None
    rollout = SINGLE_TURN.old_log_probs.clone()
    rollout[1] -= math.log(2.0)
    inputs = dataclasses.replace(SINGLE_TURN, rollout_log_probs=rollout)
    mask_mode = RolloutCorrectionConfig(level="token", mode="mask", upper=1.5)
    adv, _ = _run("optimal_token_baseline", inputs, rollout_correction=mask_mode)
    b0, b1 = (1 * 0.5 + 1 * 1) / (0.5 + 0 + 1), (1 * 2 + 1 * 2) / (2 + 0 + 2)
    torch.testing.assert_close(adv[:3, :2], _t([[1 - b0, 1 - b1], [-b0, -b1], [1 - b0, 1 - b1]]))


def test_otb_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="sum_pi_squared"):
        _run("optimal_token_baseline", _outcome_inputs([1.0], [[1]], [0]))


def test_sum_pi_squared_from_logits() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])  # π = [1/4, 3/4]
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), torch.tensor([0.625]))
    torch.testing.assert_close(sum_pi_squared_from_logits(2 * logits, temperature=2.0), torch.tensor([0.625]))


def test_estimator_traits_name_the_inputs_the_trainer_builds() -> None:
    assert estimator_traits("gdpo").needs == {"reward_components"}
    assert estimator_traits("tir_optimal_token_baseline").needs == {"sum_pi_squared"}
    assert estimator_traits("remax").needs == {"baseline_scores"}
    assert estimator_traits("grpo").needs == set()
    with pytest.raises(ValueError, match="cannot supply"):
        register_advantage_estimator("needs_logits", needs=("logits",))
