"""The embedded engine serving a vision-language model (tiny random Qwen2.5-VL) through `/generate` with image_data,
as a real server process, checked against transformers' own forward."""

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import safetensors.torch
import torch
import transformers
from cases.engine_cases import engine_client, randomize, run, start_engine
from PIL import Image

from megarl.data.images import expand_image_tokens, image_inputs
from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult, collapse_image_tokens, image_data_field
from megarl.engines.replicas.server_process import ServerProcess
from megarl.engines.weights.tensor_handles import serialize_named_tensors

ASSETS = Path(__file__).resolve().parents[2] / "megarl/assets"
TOKENIZER_VL = ASSETS / "tokenizer_vl"
VISION_START, VISION_END, IMAGE_PAD = 4096, 4097, 4098
ONE_IMAGE = [5, 6, VISION_START, IMAGE_PAD, VISION_END, 7, 8]
TWO_IMAGES = [5, VISION_START, IMAGE_PAD, VISION_END, 9, VISION_START, IMAGE_PAD, VISION_END, 7]
SIZES = [(56, 84), (112, 56)]
"""(width, height) of the first and second image: 6x4 and 4x8 patches of 14 pixels,"""
IMAGE_TOKENS = [6, 8]
"""and so 6 and 2 image tokens (2x2 patches merged into one)."""
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def _png(seed: int, size: tuple[int, int]) -> str:
    """A base64 PNG of random pixels, `size` = (width, height)."""
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _save_vl(path: Path, seed: int) -> Path:
    """tiny_qwen2_5_vl with random O(1)-logit weights, saved under its on-disk (checkpoint) names."""
    config = transformers.AutoConfig.from_pretrained(ASSETS / "models/tiny_qwen2_5_vl")
    model = transformers.AutoModelForImageTextToText.from_config(config)
    randomize(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_vl(tmp_path_factory.mktemp("vl") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server: ServerProcess
    server, url = start_engine(vl_dir, tmp_path_factory.mktemp("logs"), "--tokenizer-path", str(TOKENIZER_VL))
    yield url
    server.stop()


async def _generate(url: str, prompt: list[int], images: list[str], sampling: SamplingParams) -> list[GenerateResult]:
    client = engine_client(url)
    try:
        return await client.generate(prompt, sampling, return_logprob=True, image_data=images)
    finally:
        await client.close()


@torch.no_grad()
def _hf_reference(
    model_dir: Path, prompt: list[int], images: list[str], steps: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens after `prompt` (one placeholder per image, expanded here), and the log-probs of
    those tokens and of the expanded prompt's tokens 1.. from one full forward of prompt + tokens with pixels, grids
    and mm_token_type_ids (the model makes its M-RoPE positions from them)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, vision = torch.tensor([prompt]), {}
    if images:
        pixels = image_inputs(images, transformers.AutoImageProcessor.from_pretrained(TOKENIZER_VL))
        ids = torch.tensor([expand_image_tokens(prompt, pixels.token_counts(2), IMAGE_PAD)])
        vision = {"pixel_values": pixels.pixel_values, "image_grid_thw": pixels.grid_thw}
    greedy = {"max_new_tokens": steps, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    full = model.generate(ids, **vision, mm_token_type_ids=(ids == IMAGE_PAD).int(), **greedy)
    logits = model(full, **vision, mm_token_type_ids=(full == IMAGE_PAD).int()).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, full[0, 1:, None])[:, 0]
    return full[0, ids.shape[1] :].tolist(), logprobs[ids.shape[1] - 1 :], logprobs[: ids.shape[1] - 1]


@pytest.mark.parametrize("prompt", [ONE_IMAGE, TWO_IMAGES], ids=["one_image", "two_images"])
def test_greedy_with_images_matches_transformers(engine: str, vl_dir: Path, prompt: list[int]) -> None:
    images = [_png(seed, size) for seed, size in enumerate(SIZES[: prompt.count(IMAGE_PAD)], start=1)]
    [result] = run(_generate(engine, prompt, images, GREEDY))
    tokens, logprobs, _ = _hf_reference(vl_dir, prompt, images, GREEDY.max_new_tokens)
    assert result.output_ids == tokens
    torch.testing.assert_close(torch.tensor(result.output_logprobs), logprobs, atol=1e-4, rtol=0)
    assert result.prompt_tokens == len(prompt) + sum(IMAGE_TOKENS[: len(images)]) - len(images), "expanded"


def test_a_batch_mixing_text_and_images_decodes_together(engine: str, vl_dir: Path) -> None:
    """One batched request: every prompt scored and prefilled (those with images alone), then decoded in one batch,
    each row at its own positions."""
    images = [[_png(1, SIZES[0])], None, [_png(2, SIZES[0]), _png(3, SIZES[1])]]
    prompts = [ONE_IMAGE, [5, 6, 7, 8], TWO_IMAGES]
    body = {"input_ids": prompts, "image_data": images, "sampling_params": GREEDY.to_json(), "return_logprob": True}
    body["logprob_start_len"] = 0  # input log-probs too: a forward of the prompt with its images (prefill.py)

    async def scenario() -> tuple[list[dict], dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(engine + "/generate", json=body) as reply:
                results = await reply.json()
            async with session.get(engine + "/server_info") as reply:
                return results, await reply.json()

    results, info = run(scenario())
    assert info["embedded_stats"]["max_batch_size"] >= 3
    for prompt, prompt_images, result in zip(prompts, images, results, strict=True):
        tokens, logprobs, prompt_logprobs = _hf_reference(vl_dir, prompt, prompt_images or [], GREEDY.max_new_tokens)
        assert result["output_ids"] == tokens
        meta = result["meta_info"]
        got = torch.tensor([entry[0] for entry in meta["output_token_logprobs"]])
        torch.testing.assert_close(got, logprobs, atol=1e-4, rtol=0)
        got = torch.tensor([entry[0] for entry in meta["input_token_logprobs"][1:]])  # the first is null
        torch.testing.assert_close(got, prompt_logprobs, atol=1e-4, rtol=0)


def test_images_reach_the_model_and_n_samples_share_them(engine: str) -> None:
    sampling = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, n=2)
    first = run(_generate(engine, ONE_IMAGE, [_png(1, (56, 84))], sampling))
    other = run(_generate(engine, ONE_IMAGE, [_png(3, (56, 84))], sampling))
    assert first[0].output_logprobs == first[1].output_logprobs and first[0].prompt_tokens == 12
    assert abs(first[0].output_logprobs[0] - other[0].output_logprobs[0]) > 1e-3


def test_placeholders_and_images_must_match(engine: str) -> None:
    image = _png(1, (56, 84))
    expanded = expand_image_tokens(ONE_IMAGE, [6], IMAGE_PAD)
    for prompt, images, words in (
        (TWO_IMAGES, [image], "2 image placeholder(s) (id 4098) but image_data has 1 image"),
        (expanded, [image], "6 image placeholder(s)"),  # already expanded: SGLang's processor refuses it too
        (ONE_IMAGE, [], "image placeholders (id 4098) but no image_data"),
    ):
        with pytest.raises(EngineError, match=r"400.*" + words.replace("(", r"\(").replace(")", r"\)")):
            run(_generate(engine, prompt, images, GREEDY))


def test_weight_update_by_checkpoint_names(engine: str, tmp_path: Path) -> None:
    second = _save_vl(tmp_path / "second", seed=5)
    named = sorted(safetensors.torch.load_file(second / "model.safetensors").items())
    assert {name.split(".")[0] for name, _ in named} == {"lm_head", "model", "visual"}, "on-disk names"

    async def push() -> None:
        client = engine_client(engine)
        await client.begin_weight_update()
        await client.update_weights_from_tensor([serialize_named_tensors(named)], weight_version="v1")
        await client.end_weight_update()
        await client.close()

    run(push())
    images = [_png(1, (56, 84))]
    [result] = run(_generate(engine, ONE_IMAGE, images, GREEDY))
    tokens, logprobs, _ = _hf_reference(second, ONE_IMAGE, images, GREEDY.max_new_tokens)
    assert result.output_ids == tokens and result.weight_version == "v1"
    torch.testing.assert_close(torch.tensor(result.output_logprobs), logprobs, atol=1e-4, rtol=0)


def test_client_sends_images_as_sglang_reads_them() -> None:
    assert image_data_field(["a", "b"], n=1) == ["a", "b"]
    assert image_data_field(["a", "b"], n=4) == [["a", "b"]]
    assert collapse_image_tokens(expand_image_tokens(TWO_IMAGES, IMAGE_TOKENS, IMAGE_PAD), IMAGE_PAD) == TWO_IMAGES
