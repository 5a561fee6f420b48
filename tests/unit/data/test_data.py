"""GSM8K preprocessing, RLDataset (template, filtering, truncation, tools), collation and the loader."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import GSM8K_DIR
from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.cli.preprocess import main as preprocess_main
from megarl.data import RLDataset, StatefulDataLoader, collate_prompts, load_tool_schemas
from megarl.data.checks import DataError
from megarl.data.dataset import truncate
from megarl.rewards.gsm8k import gold_answer

TOOLS_YAML = asset_path("tools/gsm8k.yaml")


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(asset_path("tokenizer"))


def test_preprocess_full_test_split(tmp_path: Path) -> None:
    out = tmp_path / "test.parquet"
    preprocess_main(["gsm8k", "--input", str(GSM8K_DIR / "test.jsonl"), "--output", str(out)])
    rows = datasets.Dataset.from_parquet(str(out))
    assert len(rows) == 1319
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "18"}
    assert first["prompt"][0]["role"] == "user" and first["prompt"][0]["content"].startswith("Janet")
    assert first["extra_info"]["split"] == "test" and first["extra_info"]["index"] == 0
    assert rows[1318]["extra_info"]["index"] == 1318
    assert rows[5]["reward_model"]["ground_truth"] == gold_answer(rows[5]["extra_info"]["answer"])


def test_preprocess_with_tools(small_parquet: dict[str, Path]) -> None:
    rows = datasets.Dataset.from_parquet(str(small_parquet["tools"]))
    for row in rows:
        extra = row["extra_info"]
        assert extra["agent_name"] == "tool_agent"
        assert extra["tools_kwargs"] == {
            "check_answer": {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}
        }
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]


def test_preprocess_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.parquet")
    with pytest.raises(SystemExit) as missing:
        preprocess_main(["gsm8k", "--input", str(tmp_path / "nope.jsonl"), "--output", out])
    assert missing.value.code == 2 and "nope.jsonl does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(SystemExit) as no_marker:
        preprocess_main(["gsm8k", "--input", str(bad), "--output", out])
    assert no_marker.value.code == 2 and "####" in capsys.readouterr().err
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(SystemExit):
        preprocess_main(["gsm8k", "--input", str(bad), "--output", out])
    assert "has no 'answer' field" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


def test_dataset_renders_chat_template(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    ds = RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=512)
    assert len(ds) == 40 and ds.num_filtered == 0
    item = ds[3]
    expected = tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(item["prompt_ids"]) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert item["agent_name"] == "single_turn" and item["tools_kwargs"] == {} and item["index"] == 3
    assert item["reward_model"]["ground_truth"] and item["data_source"] == "openai/gsm8k"


def test_dataset_filters_overlong_prompts(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    full = RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=10_000)
    lengths = [len(full[i]["prompt_ids"]) for i in range(len(full))]
    limit = sorted(lengths)[len(lengths) // 2]
    short = RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=limit)
    assert len(short) == sum(n <= limit for n in lengths)
    assert short.num_filtered == sum(n > limit for n in lengths) > 0
    assert all(len(short[i]["prompt_ids"]) <= limit for i in range(len(short)))


def test_dataset_truncation_modes(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    path = [str(small_parquet["plain"])]
    full_ids = RLDataset(path, tokenizer, max_prompt_length=10_000)[0]["prompt_ids"]
    limit = len(full_ids) - 7
    for mode, expected in (
        ("left", full_ids[7:]),
        ("right", full_ids[:limit]),
        ("middle", full_ids[: limit // 2] + full_ids[len(full_ids) - (limit - limit // 2) :]),
    ):
        ds = RLDataset(path, tokenizer, max_prompt_length=limit, truncation=mode, filter_overlong_prompts=False)
        assert ds[0]["prompt_ids"] == expected, mode
    with pytest.raises(ValueError, match=r"row \d+ has \d+ tokens > data.max_prompt_length"):
        RLDataset(path, tokenizer, max_prompt_length=limit, truncation="error", filter_overlong_prompts=False)
    assert truncate([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]
    with pytest.raises(ValueError, match="data.truncation='top'"):
        truncate([1, 2, 3], 2, "top")


def test_dataset_tool_schemas(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    path = [str(small_parquet["tools"])]
    schemas = load_tool_schemas(str(TOOLS_YAML))
    assert list(schemas) == ["check_answer"]
    ds = RLDataset(path, tokenizer, max_prompt_length=1024, tool_schemas=schemas)
    item = ds[0]
    text = tokenizer.decode(item["prompt_ids"])
    assert "<tools>" in text and '"name": "check_answer"' in text
    assert item["agent_name"] == "tool_agent"
    assert item["tools_kwargs"]["check_answer"]["create_kwargs"]["ground_truth"] == "18"
    with pytest.raises(ValueError, match="rollout.multi_turn.tool_config_path"):
        RLDataset(path, tokenizer, max_prompt_length=1024)
    with pytest.raises(ValueError, match=r"\['check_answer'\] that the tool config does not define"):
        RLDataset(path, tokenizer, max_prompt_length=1024, tool_schemas={"other": {}})


def test_load_tool_schemas_errors(tmp_path: Path) -> None:
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: x\n")
    with pytest.raises(ValueError, match=r"tools\[0\] needs tool_schema.function.name"):
        load_tool_schemas(str(bad))
    bad.write_text("nothing: 1\n")
    with pytest.raises(ValueError, match="`tools:` list"):
        load_tool_schemas(str(bad))


def test_dataset_missing_file_and_column(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset(["missing.parquet"], tokenizer, max_prompt_length=64)
    with pytest.raises(ValueError, match="data.prompt_key='messages'"):
        RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=64, prompt_key="messages")


def _with_column(source: Path, target: Path, column: str, value: Callable[[dict[str, Any]], Any]) -> str:
    """`target`: the rows of `source` with `column` set to `value(row)`."""
    rows = [dict(row, **{column: value(row)}) for row in pq.read_table(source).to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows), target)
    return str(target)


def test_dataset_names_the_file_row_and_column_of_bad_data(  # type: ignore[no-untyped-def]
    tokenizer, small_parquet: dict[str, Path], tmp_path: Path
) -> None:
    good = str(small_parquet["plain"])
    strings = _with_column(
        small_parquet["plain"], tmp_path / "s.parquet", "prompt", lambda r: r["prompt"][0]["content"]
    )
    with pytest.raises(DataError) as info:
        RLDataset([strings], tokenizer, max_prompt_length=512)
    assert f"{strings} row 0 column 'prompt': prompt must be chat messages" in str(info.value)
    assert "wrap it or re-run megarl-preprocess" in str(info.value)
    with pytest.raises(
        DataError, match=r"plain.parquet', '[^']*s.parquet'\] \(Couldn't cast .* same columns and types"
    ):
        RLDataset([good, strings], tokenizer, max_prompt_length=512)
    third_empty = _with_column(
        small_parquet["plain"],
        tmp_path / "m.parquet",
        "prompt",
        lambda r: [] if r["extra_info"]["index"] == 3 else r["prompt"],
    )
    with pytest.raises(DataError, match=f"{third_empty} row 3 column 'prompt': prompt must be a non-empty list"):
        RLDataset([good, third_empty], tokenizer, max_prompt_length=512)
    extra = _with_column(small_parquet["plain"], tmp_path / "e.parquet", "extra_info", lambda r: "{}")
    with pytest.raises(DataError, match=f"{extra} row 0 column 'extra_info': extra_info must be a mapping"):
        RLDataset([extra], tokenizer, max_prompt_length=512)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=rf"cannot read the parquet files \['{corrupt}'\] .*re-run megarl-preprocess"):
        RLDataset([str(corrupt)], tokenizer, max_prompt_length=512)


def test_dataset_with_every_prompt_over_long_names_the_file(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    path = str(small_parquet["plain"])
    with pytest.raises(DataError) as info:
        RLDataset([path], tokenizer, max_prompt_length=5)
    msg = str(info.value)
    assert f"['{path}']: all 40 prompts are over data.max_prompt_length=5 tokens (the shortest has" in msg
    assert "raise data.max_prompt_length, or set data.filter_overlong_prompts=false" in msg


def test_collate_left_pads(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    ds = RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=400)
    rows = [ds[0], ds[1]]
    batch = collate_prompts(rows, tokenizer.pad_token_id, 400)
    assert batch["input_ids"].shape == (2, 400) and len(batch) == 2
    for i, row in enumerate(rows):
        n = len(row["prompt_ids"])
        assert batch["input_ids"][i, -n:].tolist() == row["prompt_ids"]
        assert batch["attention_mask"][i].sum() == n and batch["attention_mask"][i, : 400 - n].sum() == 0
        assert batch["position_ids"][i, -n:].tolist() == list(range(n))
        assert batch["raw_prompt_ids"][i] == row["prompt_ids"]
    assert list(batch["index"]) == [0, 1]
    assert batch["reward_model"][0]["ground_truth"] == rows[0]["reward_model"]["ground_truth"]


class _Rows:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n: int = 10, batch: int = 3, seed: int = 7, shuffle: bool = True) -> StatefulDataLoader[list[int]]:
    return StatefulDataLoader(_Rows(n), batch, list, shuffle=shuffle, seed=seed)


def test_loader_epochs_are_deterministic_permutations() -> None:
    loader = _loader()
    assert len(loader) == 3
    epoch0 = list(loader)
    epoch1 = list(loader)
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len({i for b in epoch0 for i in b}) == 9
    assert epoch0 != epoch1
    assert list(_loader()) == epoch0
    assert list(_loader(seed=8)) != epoch0
    assert list(_loader(shuffle=False)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_loader_resumes_mid_epoch_and_across_epochs() -> None:
    reference = _loader()
    expected = list(reference) + list(reference)
    for consumed in range(6):
        first = _loader()
        it = iter(first)
        seen = []
        while len(seen) < consumed:
            try:
                seen.append(next(it))
            except StopIteration:
                it = iter(first)
        state = first.state_dict()
        resumed = _loader()
        resumed.load_state_dict(state)
        rest = list(resumed)
        if len(seen) + len(rest) < 6:
            rest += list(resumed)
        assert seen + rest == expected, consumed


def test_loader_state_errors() -> None:
    loader = _loader()
    with pytest.raises(ValueError, match="same data.seed"):
        loader.load_state_dict({"epoch": 0, "batches_consumed": 1, "seed": 99})
    with pytest.raises(ValueError, match="outside 0..3"):
        loader.load_state_dict({"epoch": 0, "batches_consumed": 4, "seed": 7})
    with pytest.raises(ValueError, match="fewer than one batch of 20"):
        _loader(n=10, batch=20)


def test_loader_serves_batches(tokenizer, small_parquet: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    ds = RLDataset([str(small_parquet["plain"])], tokenizer, max_prompt_length=400)

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(ds, 8, lambda rows: collate_prompts(rows, tokenizer.pad_token_id, 400), seed=1)

    batches = list(make())
    assert len(batches) == 5 and all(b["input_ids"].shape == (8, 400) for b in batches)
    assert sorted(i for b in batches for i in b["index"]) == list(range(40))
    assert torch.equal(batches[0]["input_ids"], next(iter(make()))["input_ids"])
