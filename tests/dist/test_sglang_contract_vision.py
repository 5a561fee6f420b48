"""megarl's `/generate` bodies with images checked against SGLang 0.5.23's own normalization, on CPU (the contract
tier of tests/dist/test_sglang_contract.py; the field itself is checked there with every request field): each sample
gets the prompt's images in order, as the embedded engine reads them too."""

import asyncio
from typing import Any

import pytest
from cases.sglang_env import run_side, sglang_site

from megarl.engines.client import sglang_api
from megarl.engines.client.client import EngineClient
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.embedded.vision import images_per_prompt

pytestmark = pytest.mark.slow


class _Sent(Exception):
    """Carries the body a client would have posted."""


def _generate_body(sampling: SamplingParams, image_data: list[str] | None) -> dict[str, Any]:
    """The `/generate` body EngineClient.generate posts for one prompt with `image_data`."""
    client = EngineClient("http://127.0.0.1:1")

    async def capture(method: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        raise _Sent(payload)

    client._call = capture  # type: ignore[method-assign]
    with pytest.raises(_Sent) as sent:
        asyncio.run(client.generate([5, 4096, 4098, 4097, 7], sampling, image_data=image_data))
    return sent.value.args[0]


def test_image_data_reaches_every_sample_as_sglang_normalizes_it() -> None:
    images = ["aW1hZ2Ux", "aW1hZ2Uy"]
    text = _generate_body(SamplingParams(n=3), None)
    bodies = [_generate_body(SamplingParams(n=n), images) for n in (1, 3)]
    flat = {**bodies[1], "image_data": images}  # a flat list with n > 1: SGLang reads one image per prompt
    answers = run_side(sglang_site(), "generate_images", {"bodies": [*bodies, flat]})
    assert "image_data" not in text
    assert answers[:2] == [{"samples": [images]}, {"samples": [images] * 3}]
    assert "The length of image_data should be equal to the batch size" in answers[2]["error"]
    for body in bodies:
        sglang_api.check_payload("/generate", body)
        assert images_per_prompt(body["image_data"], batched=False, num_prompts=1) == [images]


def test_sglang_expands_image_placeholders_itself() -> None:
    """The lines of SGLang's multimodal path that make `input_ids` carry one placeholder per image (vision.py)."""
    site = sglang_site() / "sglang/srt/multimodal/processors"
    base, qwen = (site / "base_processor.py").read_text(), (site / "qwen_vl.py").read_text()
    assert "rebuilt.extend([placeholder_token_id] * counts[next_image_idx])" in base  # _expand_input_ids
    assert "prompt = self._tokenizer.decode(prompt)" in base  # load_mm_data: ids → text for the HF processor
    assert r'r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>|<image>"' in qwen  # one image per run
