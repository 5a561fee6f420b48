"""The discriminative reward model as a Megatron role: `RewardModelWorker` on 2 gloo ranks scores left-padded
conversations as transformers' `*ForSequenceClassification` does, at TP2 and PP2, padded and packed."""

from pathlib import Path

import torch
from cases.reward_cases import hf_classifier_scores, rank_rm_scores, rm_rows, save_classifier
from conftest import compose_config

from megarl.config.training import MegatronConfig
from megarl.megatron.launch import spawn
from megarl.workers.settings import RewardModelSettings

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
"""(TP, PP) of each layout."""
KEEP_LAST = 24
"""The packed case's max_length: shorter than every conversation, so each row is cut."""


def test_scores_match_transformers_at_the_last_token(tmp_path: Path) -> None:
    model_dir = save_classifier(tmp_path / "rm")
    ids, mask = rm_rows(model_dir)
    expected, per_position = hf_classifier_scores(model_dir, ids, mask)
    cut_ids, cut_mask = rm_rows(model_dir, keep_last=KEEP_LAST)
    assert cut_ids.shape[1] == KEEP_LAST < int(mask.sum(dim=1).min())
    expected_cut, _ = hf_classifier_scores(model_dir, cut_ids, cut_mask)
    # the checks can fail: the lengths differ, and any other position (or a zero head) scores differently
    assert len(set(mask.sum(dim=1).tolist())) == len(mask)
    assert torch.equal(expected, per_position[:, -1])
    assert (per_position[:, -2] - expected).abs().min() > 1e-2 and expected.abs().min() > 1e-2
    assert (expected_cut - expected).abs().min() > 1e-3

    cases = []  # one 2-rank world runs both layouts (a spawn's start-up is most of the time)
    for name, (tp, pp) in LAYOUTS.items():
        for packing, case, max_length in ((False, "padded", 4096), (True, "packed+cut", KEEP_LAST)):
            megatron = MegatronConfig(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_packing=packing
            )
            cases.append((f"{name}/{case}", megatron, max_length))
    results = spawn(rank_rm_scores, 2, model_dir, cases, ids, mask)
    for result in results:  # every rank (both stages under PP) holds the scores
        for name in LAYOUTS:
            padded, packed = result[f"{name}/padded"], result[f"{name}/packed+cut"]
            assert padded.dtype == torch.float32 and padded.shape == (len(ids),)
            assert (padded - expected).abs().max() <= 1e-4, (name, padded, expected)
            assert (packed - expected_cut).abs().max() <= 1e-4, (name, packed, expected_cut)
        assert torch.equal(result["tp2/padded+restored"], result["tp2/padded"])
    assert results[0]["released_bytes"] > 0


def test_settings_come_from_reward_model_discriminative() -> None:
    rm = "reward_model.discriminative"
    cfg = compose_config(
        "trainer=cpu",
        f"{rm}.enable=true",
        f"{rm}.path=/models/rm",
        f"{rm}.megatron.pipeline_model_parallel_size=2",
        f"{rm}.micro_batch_size=3",
        f"{rm}.max_length=512",
        f"{rm}.offload=false",
    )
    s = RewardModelSettings.from_config(cfg)
    assert s.model.weights_path == s.model.model.path == "/models/rm" and s.model.model.dtype == cfg.model.dtype
    assert s.model.value_head and s.model.optim is None and s.model.megatron.pipeline_model_parallel_size == 2
    assert (s.micro.micro_batch_size, s.max_length, s.offload) == (3, 512, False)
