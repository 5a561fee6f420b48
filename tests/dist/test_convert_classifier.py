"""HF `*ForSequenceClassification` ⇄ megatron checkpoints: `score.weight` is the value head, and `verify` compares
megatron's scores at the last token with transformers' logits."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from cases.reward_cases import save_classifier, save_judge
from safetensors.torch import save_file

from megarl.cli.convert import run
from megarl.convert.classifier import ClassifierError, require_classifier
from megarl.convert.stream import hf_to_mcore, mcore_to_hf
from megarl.convert.verify import compare_tensors, fixed_scored_rows, hf_scores
from megarl.megatron.dcp_io import DcpReader
from megarl.megatron.weights import SafetensorsReader


def _with_negated_head(hf_dir: Path, out: Path) -> Path:
    shutil.copytree(hf_dir, out)
    reader = SafetensorsReader(out)
    tensors = {name: reader.get(name) for name in reader.names()}
    save_file(tensors | {"score.weight": -tensors["score.weight"]}, str(out / "model.safetensors"))
    return out


def test_round_trip_keeps_the_score_head_and_verify_compares_scores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_dir = save_classifier(tmp_path / "hf")
    hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2)
    stored = DcpReader(tmp_path / "mcore").entries.tensors
    assert stored["output_layer.weight"][0] == (1, 64)  # the value head's key and shape, as a critic saves it

    ids, mask = fixed_scored_rows(4096)
    scores = hf_scores(hf_dir, ids, mask)
    assert len(set(mask.sum(dim=1).tolist())) == len(mask) and scores.abs().min() > 1e-2  # a zero head would fail
    assert run(["verify", "--hf", str(hf_dir), "--mcore", str(tmp_path / "mcore")]) == 0
    out = capsys.readouterr().out
    assert "tensors: 27 compared, 0 differ" in out and out.strip().endswith("OK")
    found = re.search(r"scores: max \|Δ\| (\S+) \(accepted 0.0001\)", out)
    assert found is not None and float(found.group(1)) <= 1e-4

    negated = _with_negated_head(hf_dir, tmp_path / "negated")  # what verify compares: the head and its scores
    assert compare_tensors(negated, tmp_path / "mcore", classifier=True, atol=0.0)[1][0].startswith("score.weight:")
    torch.testing.assert_close(hf_scores(negated, ids, mask), -scores)

    mcore_to_hf(tmp_path / "mcore", hf_dir, tmp_path / "back")
    returned, reader = SafetensorsReader(tmp_path / "back"), SafetensorsReader(hf_dir)
    assert "score.weight" in returned.names() and "lm_head.weight" not in returned.names()
    assert sorted(returned.names()) == sorted(reader.names())
    assert all(torch.equal(returned.get(name), reader.get(name)) for name in reader.names())


def test_a_classifier_with_other_than_one_label_is_refused(tmp_path: Path) -> None:
    hf_dir = save_classifier(tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    config["label2id"] = {"bad": 0, "good": 1}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ClassifierError, match=r"hf/config.json: num_labels is 2 .*use a classifier with num_labels=1"):
        hf_to_mcore(hf_dir, tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()

    judge = save_judge(tmp_path / "judge")  # a causal LM is no reward model
    with pytest.raises(ClassifierError, match=r"path=.*judge: .*\['Qwen2ForCausalLM'\]; a reward model is"):
        require_classifier(judge, "path")
