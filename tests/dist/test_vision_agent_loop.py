"""A vision-language tool loop against a real embedded engine: the prompt's image and the image a tool answers with
reach the engine as `image_data` (one placeholder per image in the request), while the trajectory keeps every image
token expanded, as the trainer reads it, with the images' patches in token order (`multi_modal_inputs`)."""

import dataclasses
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cases.agent_cases import RecordingRouter
from cases.engine_cases import run, start_engine
from cases.vision_agent_cases import SHOW_SCHEMA, colour_model, colour_script, expanded_training_ids, vl_chat
from PIL import Image

from megarl.agents.base import AgentContext, AgentOutput, AgentSample
from megarl.agents.images import TrajectoryImages
from megarl.agents.tool_loop import ToolAgentLoop
from megarl.agents.tool_parsers import HermesParser
from megarl.agents.tools.swatch import ShowColourTool, swatch
from megarl.assets import asset_path
from megarl.data.images import ImageProcessor
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult

IMAGE_PAD = 4098


def _blue_square() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (40, 70, 230)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = colour_model(tmp_path_factory, _blue_square())
    server, url = start_engine(
        model, tmp_path_factory.mktemp("logs"), "--tokenizer-path", str(asset_path("tokenizer_vl"))
    )
    try:
        yield url
    finally:
        server.stop()


class SampledImageToken(RecordingRouter):
    """The engine's first turn with its second token turned into the image token, as if the policy had sampled it."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *args: Any, **kwargs: Any
    ) -> list[GenerateResult]:
        [result] = await super().generate(input_ids, sampling, *args, **kwargs)
        if len(self.requests) == 1:
            result = dataclasses.replace(result, output_ids=[result.output_ids[0], IMAGE_PAD, *result.output_ids[2:]])
        return [result]


def _roll(url: str, router_class: type[RecordingRouter] = RecordingRouter) -> tuple[AgentOutput, AgentSample, Any]:
    chat = vl_chat()
    codec = ImageProcessor(str(asset_path("tokenizer_vl")), IMAGE_PAD)
    script = colour_script()

    async def go() -> tuple[AgentOutput, RecordingRouter]:
        router = router_class(url)
        context = AgentContext(
            router=router,
            chat=chat,
            response_length=200,
            tools={"show_colour": ShowColourTool({}, SHOW_SCHEMA)},
            parser=HermesParser(),
            images=codec,
        )
        inputs = codec.inputs([_blue_square()])
        prompt = codec.expand(script.prompt_ids(chat), inputs)
        images = TrajectoryImages(encoded=[], inputs=None)
        images.add(inputs, [_blue_square()])
        sample = AgentSample(sample_id="colour", prompt_ids=prompt, messages=script.prompt, images=images)
        try:
            return await ToolAgentLoop(context).run(sample, SamplingParams(temperature=0.0)), sample, router
        finally:
            await router.close()

    return run(go())


def test_a_tool_image_joins_the_trajectory_expanded_and_reaches_the_engine(engine: str) -> None:
    out, sample, router = _roll(engine)
    ids, mask, inputs = expanded_training_ids(vl_chat(), [_blue_square(), swatch("red")])
    assert out.prompt_ids + out.response_ids == ids, "token in, token out, with both images expanded"
    assert out.response_mask == mask[len(out.prompt_ids) :]
    assert (out.finish_reason, out.metrics["num_tool_calls"], out.metrics["tool/show_colour/images"]) == ("stop", 1, 1)
    assert sample.images is not None and len(sample.images.encoded) == 2
    assert sample.images.inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]] == inputs.grid_thw.tolist()
    assert torch.equal(sample.images.inputs["pixel_values"], inputs.pixel_values)
    assert sum(token == IMAGE_PAD for token in out.response_ids) == 4  # the swatch: 2×2 merged patches
    first, second = (request for request, _ in router.requests)
    assert first.count(IMAGE_PAD) == 1 and second.count(IMAGE_PAD) == 2, "requests carry one placeholder per image"


def test_a_sampled_image_token_ends_the_trajectory(engine: str) -> None:
    """A sampled `<|image_pad|>` would be one image placeholder more than the images in the next request: the loop
    ends the trajectory instead of sending it (the embedded engine answers such a request with 400)."""
    out, _, router = _roll(engine, SampledImageToken)
    assert out.finish_reason == "sampled_image_token"
    assert len(router.requests) == 1 and IMAGE_PAD in out.response_ids
