"""A tiny Qwen2.5-VL fit to one tool conversation whose tool answers with an image (`show_colour`)."""

import json
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml

from cases.agent_cases import Script, call, session_model
from megarl.agents.chat_tokens import ChatTokens
from megarl.agents.tools.swatch import swatch
from megarl.assets import asset_path
from megarl.data.images import ImageProcessor, expand_image_tokens

SHOW_SCHEMA = yaml.safe_load(asset_path("tools/shapes.yaml").read_text())["tools"][0]["tool_schema"]
"""The schema the shapes tool config offers, so a dataset row naming the tool renders the script's prompt."""
QUESTION = "Which colour is the largest shape?"


def image_turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def colour_script() -> Script:
    """The model asks to see red, reads the swatch the tool answers with, and answers."""
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    turns: list[Any] = [call("show_colour", colour="red"), image_turn("This is red."), "#### red"]
    return Script(prompt=prompt, tools=[SHOW_SCHEMA], turns=turns)


def vl_chat() -> ChatTokens:
    return ChatTokens(transformers.AutoTokenizer.from_pretrained(asset_path("tokenizer_vl")))


def script_images(prompt_image: bytes) -> list[bytes]:
    """The conversation's images in token order: the prompt's, then the red swatch."""
    return [prompt_image, swatch("red")]


def expanded_training_ids(chat: ChatTokens, images: list[bytes]) -> tuple[list[int], list[int], Any]:
    """`colour_script`'s training ids and mask with each image placeholder expanded, and the images' inputs."""
    codec = ImageProcessor(str(asset_path("tokenizer_vl")), chat.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    ids, mask = colour_script().training_ids(chat)
    inputs = codec.inputs(images)
    counts = inputs.token_counts(2)
    expanded = expand_image_tokens(ids, counts, codec.image_token_id)
    full_mask: list[int] = []
    for token, m in zip(ids, mask, strict=True):
        full_mask += [m] * (counts.pop(0) if token == codec.image_token_id else 1)
    return expanded, full_mask, inputs


def train_colour_model(prompt_image: bytes, path: Path) -> Path:
    """Fit tiny_qwen2_5_vl (its vision tower random and frozen) until every scripted token is near certain (mean
    cross-entropy < 1e-3), so that sampling at temperature 1 follows the script too."""
    chat = vl_chat()
    ids, mask, inputs = expanded_training_ids(chat, script_images(prompt_image))
    config = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_qwen2_5_vl"))
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).float()
    model.model.visual.requires_grad_(False)
    input_ids = torch.tensor([ids])
    target_mask = torch.tensor([mask[1:]], dtype=torch.bool)
    forward = {
        "input_ids": input_ids,
        "pixel_values": inputs.pixel_values,
        "image_grid_thw": inputs.grid_thw,
        "mm_token_type_ids": (input_ids == 4098).int(),
    }
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(1000):
        logits = model(**forward).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[target_mask], input_ids[:, 1:][target_mask])
        if loss.item() < 1e-3:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError("the colour model did not fit its script in 1000 steps")
    model.save_pretrained(path)
    (path / "megarl_script.json").write_text(json.dumps({"ids": ids, "mask": mask}))
    return path


def colour_model(tmp_path_factory: Any, prompt_image: bytes) -> Path:
    """`train_colour_model`'s model, once per test session (`agent_cases.session_model`)."""
    return session_model(tmp_path_factory, "colour_model", lambda path: train_colour_model(prompt_image, path))
