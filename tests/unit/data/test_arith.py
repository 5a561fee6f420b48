"""The synthetic addition task: rows, reward, preprocessing CLI, and loading through RLDataset."""

from megarl.data.arith import DATA_SOURCE, make_rows
from megarl.rewards import get_reward_fn


def test_rows_are_deterministic_and_correct() -> None:
    rows = make_rows(50, seed=3, split="train")
    assert rows == make_rows(50, seed=3, split="train") and rows != make_rows(50, seed=4, split="train")
    for row in rows:
        a, b = (int(x) for x in row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert row["reward_model"]["ground_truth"] == str(a + b) and a + b <= 9
        assert row["data_source"] == DATA_SOURCE


def test_reward_scores_the_first_number() -> None:
    reward = get_reward_fn(DATA_SOURCE)
    assert reward("7", "7").score == 1.0 and reward(" 7 is it", "7").extra == {"acc": 1.0, "has_number": 1.0}
    assert reward("3", "7").score == 0.1
    assert reward("no digits", "7").score == 0.0
    assert reward("12", "1").score == 0.1  # 12 is not 1
    assert reward("x5", "7", format_score=0.0).score == 0.0
