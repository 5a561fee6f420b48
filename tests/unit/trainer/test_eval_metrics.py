"""Validation's n-sample metrics (megarl/trainer/eval_metrics.py): pass@k against subset enumeration,
maj@k's vote and tie rule by hand, the bootstrap against exact expectations, the per-source rows →
metrics aggregation the driver logs, the reward answers it votes over, and the `rollout.val` checks."""

import itertools
from collections import Counter

import numpy as np
import pytest
from conftest import compose_config

from megarl.config import ConfigError
from megarl.config.rollout import SamplingConfig, val_sampling_problems
from megarl.plan.gate import validate
from megarl.trainer.eval_metrics import (
    NO_ANSWER,
    answer_ids,
    bootstrap_at_k,
    majority_scores,
    pass_at_k,
    prompt_metrics,
    sample_sizes,
    validation_metrics,
)


@pytest.mark.parametrize(("n", "ks"), [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (6, [1, 2, 4, 6])])
def test_sample_sizes(n: int, ks: list[int]) -> None:
    assert sample_sizes(n) == ks


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 3 of the 6 pairs hold the passing sample
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # only 1 of the 6 pairs misses both
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_pass_at_k_equals_the_share_of_k_subsets_with_a_pass() -> None:
    for n in range(1, 7):
        for c in range(n + 1):
            passed = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(passed, k))
                share = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12), (n, c, k)


def test_answer_ids() -> None:
    assert answer_ids(["7", None, "3", "7"]).tolist() == [0, NO_ANSWER, 1, 0]
    assert answer_ids([None, None]).tolist() == [NO_ANSWER, NO_ANSWER]


def test_majority_vote_by_hand() -> None:
    three = majority_scores(
        np.array([[0, 0, 1], [0, 1, 1], [0, 1, 2], [-1, -1, 0], [0, 0, 1], [-1, -1, -1]]),
        np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0], [0.1, 0.1, 1], [1, 0.5, 0], [0.1, 0.2, 0.3]]),
    )
    # majority right; majority wrong; three-way tie averages the three answers; one vote beats two
    # abstentions; an answer scores the mean of its samples; all abstain: the mean of the draw
    assert three.tolist() == pytest.approx([1.0, 0.0, 1 / 3, 1.0, 0.75, 0.2])
    assert majority_scores(np.array([[0, 0, 1, 1]]), np.array([[1.0, 1.0, 0.0, 0.0]])).tolist() == [0.5]  # tie
    assert majority_scores(np.array([[-1, -1]]), np.array([[0.2, 0.4]])).tolist() == pytest.approx([0.3])


def _vote(answers: tuple[str | None, ...], scores: tuple[float, ...]) -> float:
    """maj@k of one draw, written independently of `majority_scores` (same documented rule)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return float(np.mean(scores))
    top = max(counts.values())
    winners = [a for a, c in counts.items() if c == top]
    return float(np.mean([np.mean([s for a, s in zip(answers, scores, strict=True) if a == w]) for w in winners]))


def _exact(scores: list[float], answers: list[str | None], k: int) -> dict[str, float]:
    """best@k, worst@k, maj@k as exact means over every draw of k samples with replacement."""
    draws = list(itertools.product(range(len(scores)), repeat=k))
    return {
        f"best@{k}": float(np.mean([max(scores[i] for i in d) for d in draws])),
        f"worst@{k}": float(np.mean([min(scores[i] for i in d) for d in draws])),
        f"maj@{k}": float(np.mean([_vote(tuple(answers[i] for i in d), tuple(scores[i] for i in d)) for d in draws])),
    }


def test_bootstrap_matches_the_exact_expectation_over_all_draws() -> None:
    scores, answers = [0.0, 0.5, 1.0, 1.0, 0.1], ["3", "4", "7", "7", None]
    for k in (2, 4):
        got = bootstrap_at_k(np.array(scores), answer_ids(answers), k, np.random.default_rng(0))
        # 1000 draws of values in [0, 1]: standard error below 0.016
        assert got == pytest.approx(_exact(scores, answers, k), abs=0.05)
        assert got == bootstrap_at_k(np.array(scores), answer_ids(answers), k, np.random.default_rng(0))  # seeded
    assert set(bootstrap_at_k(np.array(scores), None, 2, np.random.default_rng(0))) == {"best@2", "worst@2"}


def test_prompt_metrics_of_equal_samples_are_exact() -> None:
    got = prompt_metrics(np.full(4, 0.5), answer_ids(["1"] * 4), 0.5, np.random.default_rng(0))
    at_k = {f"{name}@{k}": 0.5 for k in (2, 4) for name in ("best", "worst", "maj")}
    assert got == {"mean@4": 0.5, "pass@1": 1.0, "pass@2": 1.0, "pass@4": 1.0} | at_k


def _rows() -> dict[str, list]:
    """Two gsm8k prompts and one tool prompt (no answers), 4 samples each, interleaved as samples_of does."""
    return {
        "data_sources": ["gsm8k"] * 4 + ["tools"] * 4 + ["gsm8k"] * 4,
        "uids": ["v:0"] * 4 + ["v:1"] * 4 + ["v:2"] * 4,
        "scores": [1.0, 0.1, 0.1, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.1, 0.1],
        "answers": ["7", "3", "3", None, None, None, None, None, "9", "9", "2", "2"],
    }


def test_validation_metrics_per_source() -> None:
    got = validation_metrics(**_rows(), threshold=1.0, seed=42)
    at_k = [f"{name}@{k}" for k in (2, 4) for name in ("best", "worst")]
    assert set(got) == {"reward/score/mean"} | {
        f"{source}/{name}"
        for source, maj in (("gsm8k", ["maj@2", "maj@4"]), ("tools", []))
        for name in ["score/mean", "mean@4", "pass@1", "pass@2", "pass@4", *at_k, *maj]
    }
    assert got["reward/score/mean"] == pytest.approx(5.4 / 12)
    assert got["gsm8k/score/mean"] == got["gsm8k/mean@4"] == pytest.approx((1.2 / 4 + 2.2 / 4) / 2)
    # 0.1 (a wrong answer's partial credit) is below the threshold: c = 1 and c = 2 of n = 4
    assert got["gsm8k/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert got["gsm8k/pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
    assert got["gsm8k/pass@4"] == 1.0
    assert got["tools/pass@2"] == pytest.approx(5 / 6)
    rows = _rows()
    for k in (2, 4):
        prompts = [_exact(rows["scores"][i : i + 4], rows["answers"][i : i + 4], k) for i in (0, 8)]
        for name in (f"best@{k}", f"worst@{k}", f"maj@{k}"):
            assert got[f"gsm8k/{name}"] == pytest.approx((prompts[0][name] + prompts[1][name]) / 2, abs=0.05), name
    assert got["gsm8k/worst@4"] < got["gsm8k/worst@2"] < got["gsm8k/mean@4"] < got["gsm8k/best@2"] < got["gsm8k/best@4"]
    assert got == validation_metrics(**_rows(), threshold=1.0, seed=42)
    assert got != validation_metrics(**_rows(), threshold=1.0, seed=43)


def test_one_sample_per_prompt_keeps_todays_metrics() -> None:
    got = validation_metrics(["a", "b", "a"], ["v:0", "v:1", "v:2"], [1.0, 0.0, 0.5], ["1", None, "2"], 1.0, 0)
    assert got == {
        "reward/score/mean": 0.5,
        "a/score/mean": 0.75,
        "a/mean@1": 0.75,
        "a/pass@1": 0.5,
        "b/score/mean": 0.0,
        "b/mean@1": 0.0,
        "b/pass@1": 0.0,
    }


def test_prompts_with_different_sample_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="same number of samples"):
        validation_metrics(["a"] * 3, ["v:0", "v:0", "v:1"], [1.0, 0.0, 1.0], [None] * 3, 1.0, 0)


def test_val_sampling_problems() -> None:
    assert val_sampling_problems(SamplingConfig(temperature=0.0)) == []  # the greedy default
    assert val_sampling_problems(SamplingConfig(temperature=1.0, n=4)) == []
    (same,) = val_sampling_problems(SamplingConfig(temperature=0.0, n=4))
    assert "rollout.val.n=4 greedy samples would all be the same; set rollout.val.temperature > 0" in same
    bad = val_sampling_problems(SamplingConfig(temperature=-1.0, top_p=0.0))
    assert bad == ["rollout.val.temperature=-1.0 must be >= 0 (0 = greedy)", "rollout.val.top_p=0.0 must be in (0, 1]"]


def test_validate_refuses_greedy_val_n(data_overrides: list[str]) -> None:
    validate(compose_config("rollout.val.n=4", "rollout.val.temperature=1.0", *data_overrides))
    with pytest.raises(ConfigError, match=r"rollout.val.n=4 greedy samples"):
        validate(compose_config("rollout.val.n=4", *data_overrides))
