"""RLDataset with an `images` column: placeholders expanded to one token per merged patch by the model's image
processor, over-long rows dropped on the expanded length, named errors, and the columns rollout reads."""

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.batch import MULTI_MODAL_COLUMN
from megarl.data import RLDataset, collate_prompts
from megarl.data.arith import write_rows
from megarl.data.checks import DataError
from megarl.data.images import ImageProcessor

IMAGE_PAD = 4098


def _png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(images: list[Any], parts: int | None = None, text: str = "Which colour?") -> dict[str, Any]:
    content = [{"type": "image", "text": None}] * (len(images) if parts is None else parts)
    return {
        "data_source": "megarl/shapes",
        "prompt": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
        "images": images,
        "reward_model": {"style": "rule", "ground_truth": "red"},
        "extra_info": {"index": 0},
    }


@pytest.fixture(scope="module")
def vl_tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(asset_path("tokenizer_vl"))


def _dataset(tmp_path: Path, rows: list[dict[str, Any]], tokenizer: Any, **kwargs: Any) -> RLDataset:
    write_rows(tmp_path / "rows.parquet", rows)
    return RLDataset([str(tmp_path / "rows.parquet")], tokenizer, max_prompt_length=kwargs.pop("length", 512), **kwargs)


def test_placeholders_expand_to_one_token_per_merged_patch(tmp_path: Path, vl_tokenizer: Any) -> None:
    rows = [_row([_png(56, 56)]), _row([_png(84, 56), _png(112, 112)])]
    data = _dataset(tmp_path, rows, vl_tokenizer)
    one, two = data[0], data[1]
    assert one["prompt_ids"].count(IMAGE_PAD) == 4  # 56×56: 4×4 patches of 14, 2×2 merged
    assert two["prompt_ids"].count(IMAGE_PAD) == 6 + 16
    assert two[MULTI_MODAL_COLUMN]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]
    assert two[MULTI_MODAL_COLUMN]["pixel_values"].shape == (24 + 64, 3 * 2 * 14 * 14)
    batch = collate_prompts([one, two], pad_token_id=0, max_prompt_length=512)
    assert [len(images) for images in batch["images"]] == [1, 2]
    assert torch.equal(batch[MULTI_MODAL_COLUMN][1]["image_grid_thw"], two[MULTI_MODAL_COLUMN]["image_grid_thw"])


def test_token_counts_from_sizes_match_the_processors_grids() -> None:
    """The counts the dataset expands with (image sizes alone) are those of the patches the trainer gets, also for
    sizes the processor resizes: below its min_pixels (20×20), above its max_pixels (400×300), off the 28 grid."""
    codec = ImageProcessor(str(asset_path("tokenizer_vl")), IMAGE_PAD)
    images = [_png(*size) for size in ((20, 20), (56, 56), (100, 57), (400, 300), (29, 250))]
    counts = codec.token_counts(images)
    assert counts == codec.inputs(images).token_counts(codec.merge_size)
    assert counts[1] == 4 and len(set(counts)) > 3


def test_an_over_long_image_row_is_dropped_on_its_expanded_length(tmp_path: Path, vl_tokenizer: Any) -> None:
    short, long = _row([_png(56, 56)]), _row([_png(224, 224)])  # 4 and 64 image tokens
    text_length = len(_dataset(tmp_path / "a", [short], vl_tokenizer)[0]["prompt_ids"]) - 4
    data = _dataset(tmp_path / "b", [short, long], vl_tokenizer, length=text_length + 10)
    assert (len(data), data.num_filtered) == (1, 1)
    with pytest.raises(DataError, match="a prompt with images is not cut"):
        _dataset(tmp_path / "c", [long], vl_tokenizer, length=text_length + 10, filter_overlong_prompts=False,
                 truncation="left")  # fmt: skip


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_row([b"not an image"]), "cannot decode an image of 12 bytes"),
        (_row([_png(56, 56)], parts=2), "2 image placeholder\\(s\\) but 1 image"),
    ],
)
def test_bad_images_name_the_file_and_row(tmp_path: Path, vl_tokenizer: Any, row: dict, message: str) -> None:
    with pytest.raises(DataError, match=f"rows.parquet row 0 column 'images': .*{message}"):
        _dataset(tmp_path, [row], vl_tokenizer)


def test_images_with_a_text_tokenizer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no <\\|image_pad\\|> token or no preprocessor_config.json"):
        _dataset(tmp_path, [_row([_png(56, 56)])], AutoTokenizer.from_pretrained(asset_path("tokenizer")))


def test_a_text_dataset_gets_no_image_columns(tmp_path: Path, vl_tokenizer: Any) -> None:
    row = {k: v for k, v in _row([]).items() if k != "images"}
    row["prompt"] = [{"role": "user", "content": "What is 2 + 2?"}]
    assert not {"images", MULTI_MODAL_COLUMN} & set(_dataset(tmp_path, [row], vl_tokenizer)[0])


def test_shapes_rows_load_deterministic_with_the_largest_colour_as_answer(tmp_path: Path, vl_tokenizer: Any) -> None:
    """`megarl-preprocess shapes`: the same seed gives the same rows; the answer's colour covers the most pixels;
    the reward scores the first colour word."""
    import numpy as np

    from megarl.cli.preprocess import main as preprocess_main
    from megarl.data.shapes import RGB, make_rows
    from megarl.rewards import get_reward_fn

    rows = make_rows(8, seed=3, split="train", num_images=2)
    assert rows == make_rows(8, seed=3, split="train", num_images=2)
    for row in rows:
        pixels = np.concatenate([np.asarray(Image.open(io.BytesIO(b))).reshape(-1, 3) for b in row["images"]])
        counts = {name: int((pixels == rgb).all(axis=1).sum()) for name, rgb in RGB.items()}
        assert max(counts, key=counts.__getitem__) == row["reward_model"]["ground_truth"]
    out = tmp_path / "shapes.parquet"
    preprocess_main(["shapes", "--output", str(out), "--num-rows", "4", "--seed", "0", "--num-images", "2"])
    data = RLDataset([str(out)], vl_tokenizer, max_prompt_length=1024)
    assert len(data) == 4 and all(len(data[i]["images"]) == 2 for i in range(4))
    truth = rows[0]["reward_model"]["ground_truth"]
    other = next(name for name in RGB if name != truth)
    reward = get_reward_fn("megarl/shapes")
    assert reward(f"It is {truth}.", truth).score == 1.0
    assert reward(f"{other}, not {truth}", truth).score == 0.0
