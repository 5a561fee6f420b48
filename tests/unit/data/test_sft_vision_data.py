"""SFTDataset with an `images` column: placeholders expanded to one token per merged patch (no loss on image
tokens), over-long rows dropped on the expanded length and counted, errors naming file, row and column,
`collate_sft` carrying `multi_modal_inputs`, and `megarl-preprocess shapes-sft` read back."""

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, PngImagePlugin
from transformers import AutoTokenizer

from megarl.agents.chat_tokens import ChatTokens
from megarl.assets import asset_path
from megarl.batch import MULTI_MODAL_COLUMN
from megarl.cli.preprocess import main as preprocess_main
from megarl.data import SFTDataset, collate_sft
from megarl.data.arith import write_rows
from megarl.data.checks import DataError
from megarl.data.images import decode_image
from megarl.data.sft_images import SFTImages
from megarl.data.shapes import COLOURS, RGB

IMAGE_PAD = 4098


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(images: list[bytes], parts: int | None = None, answer: str = "red") -> dict[str, Any]:
    content = [{"type": "image", "text": None}] * (len(images) if parts is None else parts)
    user = {"role": "user", "content": [*content, {"type": "text", "text": "Which colour?"}]}
    return {"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": images}


@pytest.fixture(scope="module")
def chat() -> ChatTokens:
    return ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer_vl")))


def _dataset(tmp_path: Path, rows: list[dict[str, Any]], chat: ChatTokens, max_length: int = 512) -> SFTDataset:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_rows(tmp_path / "rows.parquet", rows)
    return SFTDataset([str(tmp_path / "rows.parquet")], chat, max_length=max_length)


def test_placeholders_expand_and_the_batch_carries_the_images(tmp_path: Path, chat: ChatTokens) -> None:
    data = _dataset(tmp_path, [_row([_png(56, 56)]), _row([_png(84, 56), _png(112, 112)], answer="blue")], chat)
    one, two = data[0], data[1]
    assert one["prompt_ids"].count(IMAGE_PAD) == 4  # 56×56: 4×4 patches of 14, 2×2 merged
    assert two["prompt_ids"].count(IMAGE_PAD) == 6 + 16
    assert chat.tokenizer.decode(two["response_ids"]) == "blue<|im_end|>\n"
    assert two[MULTI_MODAL_COLUMN]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]
    batch = collate_sft([one, two], chat.tokenizer.pad_token_id)
    assert batch.non_tensor_keys == [MULTI_MODAL_COLUMN]
    assert torch.equal(batch[MULTI_MODAL_COLUMN][1]["pixel_values"], two[MULTI_MODAL_COLUMN]["pixel_values"])
    assert int((batch["input_ids"] == IMAGE_PAD).sum()) == 4 + 22


def test_an_image_in_the_response_expands_without_loss(chat: ChatTokens) -> None:
    images = SFTImages.of(chat.tokenizer, ["images"], ["rows.parquet"])
    assert images is not None
    expanded = images.expand([1, IMAGE_PAD, 2], [3, IMAGE_PAD, 4], [1, 1, 1], [_png(56, 56), _png(56, 56)])
    assert expanded == ([1, *[IMAGE_PAD] * 4, 2], [3, *[IMAGE_PAD] * 4, 4], [1, 0, 0, 0, 0, 1])


def test_an_over_long_image_row_is_dropped_and_counted(tmp_path: Path, chat: ChatTokens) -> None:
    short, long = _row([_png(56, 56)]), _row([_png(224, 224)])  # 4 and 64 image tokens
    length = len(_dataset(tmp_path / "a", [short], chat)[0]["prompt_ids"]) + 10
    data = _dataset(tmp_path / "b", [short, long], chat, max_length=length)
    assert (len(data), data.num_filtered) == (1, 1)
    assert data[0]["prompt_ids"].count(IMAGE_PAD) == 4  # kept whole, never cut


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_row([_png(56, 56)], parts=2), "2 image placeholder\\(s\\) but 1 image"),
        (_row([b"not an image"]), "cannot decode an image of 12 bytes"),
    ],
)
def test_bad_images_name_the_file_row_and_column(tmp_path: Path, chat: ChatTokens, row: dict, message: str) -> None:
    with pytest.raises(DataError, match=f"rows.parquet row 0 column 'images': .*{message}"):
        _dataset(tmp_path, [row], chat)


def test_images_with_a_text_tokenizer_are_refused(tmp_path: Path) -> None:
    text_chat = ChatTokens(AutoTokenizer.from_pretrained(asset_path("tokenizer")))
    with pytest.raises(DataError, match="no <\\|image_pad\\|> token or no preprocessor_config.json"):
        _dataset(tmp_path, [_row([_png(56, 56)])], text_chat)


def test_a_text_sft_dataset_carries_no_image_column(tmp_path: Path, chat: ChatTokens) -> None:
    row = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
    data = _dataset(tmp_path, [row], chat)
    assert set(data[0]) == {"prompt_ids", "response_ids", "response_mask"}
    assert collate_sft([data[0]], chat.tokenizer.pad_token_id).non_tensor_keys == []


def test_shapes_sft_rows_read_back(tmp_path: Path, chat: ChatTokens) -> None:
    """`megarl-preprocess shapes-sft`: one colour word, then end-of-turn; with one shape and the scene's pool the
    answer is the colour drawn (which is why the demo draws from the palette)."""
    out = tmp_path / "sft.parquet"
    preprocess_main(["shapes-sft", "--output", str(out), "--num-rows", "8", "--seed", "0", "--num-shapes", "1"])
    data = SFTDataset([str(out)], chat, max_length=128)
    assert len(data) == 8 and all(data[i][MULTI_MODAL_COLUMN]["image_grid_thw"].shape == (1, 3) for i in range(8))
    rows = pq.read_table(out).to_pylist()
    for i, row in enumerate(rows):
        answer = chat.tokenizer.decode(data[i]["response_ids"]).removesuffix("<|im_end|>\n")
        assert answer in COLOURS
        pixels = {tuple(p) for p in np.asarray(Image.open(io.BytesIO(row["images"][0]))).reshape(-1, 3).tolist()}
        assert pixels == {(255, 255, 255), RGB[answer]}


def test_base64_longer_than_a_file_name_decodes() -> None:
    """Base64 text with a stretch longer than a file name (NAME_MAX 255) between its `/`s is not taken for a path
    (pathlib raised ENAMETOOLONG: the embedded engine answered HTTP 500 to the demo's one-shape images)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "a" * 300)  # base64 "YWFh…": no "/"
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (40, 70, 230)).save(buffer, format="PNG", pnginfo=info)
    text = base64.b64encode(buffer.getvalue()).decode()
    assert max(len(part) for part in text.split("/")) > 255 and len(text) < 4096
    assert decode_image(text).size == (16, 16)
