"""Routed experts (R3) from the engine side: the embedded engine records the experts each MoE layer's router
picked for every forwarded token and answers `meta_info.routed_experts` as SGLang 0.5.23 does; the client
decodes it and the router joins it across resubmissions; an agent worker asks for it in training rollouts only
and keeps the MoE layers' columns.

The reference throughout is transformers itself: one forward of the whole final sequence with
`output_router_logits=True`, top-k of each MoE layer's logits (softmax keeps the order).
"""

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import transformers
from cases.engine_cases import engine_client, load_hf, randomize, run, start_engine

from megarl.agents.postprocess import RoutingLayout
from megarl.agents.worker import AgentSettings, AgentWorker
from megarl.assets import asset_path
from megarl.batch import NO_RECORD, Batch
from megarl.config.rollout import RolloutConfig
from megarl.engines.client.client import EngineClient
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import FinishReason, GenerateResult
from megarl.engines.embedded.routing import RoutingRecorder
from megarl.engines.weights.tensor_handles import serialize_named_tensors

DENSE_LAYER = 1
"""tiny_moe grown to 3 layers, the middle one dense (mlp_only_layers): its columns must stay 0."""
NUM_LAYERS, TOP_K = 3, 2
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

SMALL = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4}
SMALL |= {"num_key_value_heads": 4, "vocab_size": 128, "num_experts_per_tok": 2, "num_hidden_layers": 3}
FAMILIES = {
    # family: (its config's own fields, the layers that have a router)
    "qwen3_moe": ({"num_experts": 4, "mlp_only_layers": [1], "head_dim": 8}, [0, 2]),
    "qwen2_moe": ({"num_experts": 4, "mlp_only_layers": [1], "shared_expert_intermediate_size": 16}, [0, 2]),
    "mixtral": ({"num_local_experts": 4}, [0, 1, 2]),
    "glm4_moe": ({"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, [1, 2]),
    "deepseek_v3": (
        {"n_routed_experts": 8, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16}
        | {"q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
        [1, 2],
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_recorder_captures_what_each_familys_experts_receive(family: str) -> None:
    """The recorder's ids per token and layer are the ids each MoE layer's experts module was called with (a
    second hook, on the experts); dense layers stay 0."""
    fields, moe_layers = FAMILIES[family]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **SMALL, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    recorder = RoutingRecorder(model)
    received: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.get_decoder().layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.register_forward_pre_hook(lambda _, args, index=index: received.__setitem__(index, args[1]))
    model(torch.randint(0, 128, (2, 5)))
    picked = recorder.take(2, 5)  # [b, s, layers, k]
    assert recorder.moe_layers == sorted(received) == moe_layers
    for layer in range(3):
        expected = received[layer].view(2, 5, 2) if layer in moe_layers else torch.zeros(2, 5, 2)
        assert torch.equal(picked[:, :, layer], expected.int()), layer


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@torch.no_grad()
def test_routers_found_by_class_name_where_transformers_does_not_record_them(family: str) -> None:
    """Before transformers 5.19, glm4_moe's and deepseek_v3's `_can_record_outputs` have no "router_logits"; a
    recorder on such a model (the entry stripped, as 5.17 ships it) finds the routers by class name and captures
    the same experts as one built from the entry."""
    fields, moe_layers = FAMILIES[family]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **SMALL, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    recorded = RoutingRecorder(model)
    model._can_record_outputs = {k: v for k, v in model._can_record_outputs.items() if k != "router_logits"}
    by_name = RoutingRecorder(model)
    model(torch.randint(0, 128, (2, 5)))
    assert by_name.moe_layers == recorded.moe_layers == moe_layers
    assert torch.equal(by_name.take(2, 5), recorded.take(2, 5))


def test_a_dense_model_has_no_routing_to_record() -> None:
    dense = transformers.AutoConfig.from_pretrained(asset_path("models/tiny_dense"))
    with pytest.raises(ValueError, match="needs a transformers MoE model; qwen2 has no router"):
        RoutingRecorder(transformers.AutoModelForCausalLM.from_config(dense))


def _reply(rows: torch.Tensor, prompt_tokens: int, output: list[int], finish: FinishReason) -> dict[str, Any]:
    meta = {"id": "r", "finish_reason": finish.to_json(), "prompt_tokens": prompt_tokens}
    meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()
    return {"output_ids": output, "meta_info": meta}


def test_results_decode_and_resumed_pieces_join() -> None:
    """from_json decodes meta_info.routed_experts into rows (prompt + output - 1 - start); `extended` joins a
    continuation asked from the next row, and refuses one asked from elsewhere."""
    routing = torch.arange(7 * 4, dtype=torch.int32).view(7, 4)  # prompt 5 + output 3 - 1, 2 layers x top-2
    aborted, length = FinishReason(type="abort", message="Aborted"), FinishReason(type="length", length=1)
    first = GenerateResult.from_json(_reply(routing[:6], 5, [1, 2], aborted), 5)
    assert first.routed_experts is not None and first.routed_experts.shape == (6, 4)
    assert first.next_routed_experts_start_len == 6
    more = GenerateResult.from_json(_reply(routing[6:], 7, [3], length), 7, routed_experts_start_len=6)
    joined = first.extended(more)
    assert joined.routed_experts is not None and torch.equal(joined.routed_experts, routing)
    misplaced = GenerateResult.from_json(_reply(routing[5:], 7, [3], length), 7, routed_experts_start_len=5)
    with pytest.raises(AssertionError, match="follow on"):
        first.extended(misplaced)
    with pytest.raises(ValueError, match="7 ids for 2 rows"):  # 5 + 3 - 1 - 5 rows
        GenerateResult.from_json(_reply(routing.flatten()[:7], 5, [1, 2, 3], aborted), 5, routed_experts_start_len=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("r3") / "model"
    path.mkdir()
    config = json.loads(asset_path("models/tiny_moe/config.json").read_text())
    config.update(num_hidden_layers=NUM_LAYERS, mlp_only_layers=[DENSE_LAYER])
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    randomize(model, seed=3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> transformers.PreTrainedModel:
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--enable-return-routed-experts")
    yield url
    server.stop()


@torch.no_grad()
def hf_routing(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, layers, k]: each MoE layer's top-k for every token but the last, in one forward."""
    logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits  # per MoE layer [T, experts]
    routing = torch.zeros(len(tokens), NUM_LAYERS, TOP_K, dtype=torch.int32)
    for layer, layer_logits in zip([i for i in range(NUM_LAYERS) if i != DENSE_LAYER], logits, strict=True):
        routing[:, layer] = layer_logits.topk(TOP_K).indices.int()
    return routing[:-1]


def _rows(result: GenerateResult) -> torch.Tensor:
    assert result.routed_experts is not None
    return result.routed_experts.view(-1, NUM_LAYERS, TOP_K)


def test_routing_equals_one_transformers_forward_and_start_len_takes_the_tail(
    url: str, hf: transformers.PreTrainedModel
) -> None:
    """Prompts of different lengths batched together (padded prefill, then decode): each gets the rows of
    prompt ‖ output from its start_len up to the last token, equal to one forward of that sequence."""
    prompts, starts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]], [0, 4, 5]

    async def scenario() -> list[GenerateResult]:
        client = engine_client(url)
        requests = [
            client.generate(p, GREEDY, return_routed_experts=True, routed_experts_start_len=s)
            for p, s in zip(prompts, starts, strict=True)
        ]
        results = [r for [r] in await asyncio.gather(*requests)]
        await client.close()
        return results

    for prompt, start, result in zip(prompts, starts, run(scenario()), strict=True):
        tokens = prompt + result.output_ids
        assert result.routed_experts_start_len == start
        assert _rows(result).shape == (len(tokens) - 1 - start, NUM_LAYERS, TOP_K)
        assert torch.equal(_rows(result), hf_routing(hf, tokens)[start:])
        assert not _rows(result)[:, DENSE_LAYER].any()


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body) as resp:
        return resp.status, await resp.json()


def test_start_len_outside_the_prompt_is_refused_like_sglang(url: str) -> None:
    """scheduler.py refuses routed_experts_start_len < 0 or > prompt tokens with 400 (a ValueError's body)."""

    async def statuses() -> list[tuple[int, Any]]:
        body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
        return [await _post(url, body | {"routed_experts_start_len": n}) for n in (-1, 4)]

    (low, low_body), (high, high_body) = run(statuses())
    assert (low, high) == (400, 400)
    assert "lower than 0" in low_body["error"]["message"]
    assert "higher than the number of input tokens (3)" in high_body["error"]["message"]


async def _push(client: EngineClient, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
    await client.begin_weight_update()
    try:
        await client.update_weights_from_tensor([serialize_named_tensors(named)], flush_cache=flush_cache)
    finally:
        await client.end_weight_update()


def test_cached_prefix_rows_are_those_of_the_forward_that_computed_them(
    url: str, hf: transformers.PreTrainedModel
) -> None:
    """Turn 2 resends turn 1's tokens; they come from the prefix cache, and so does their routing, computed
    under turn 1's router weights, although the routers were negated in between (flush_cache=false). Negated,
    layer 0's router picks the other two of its four experts: its input does not depend on any router."""
    gates = [(name, p.detach().clone()) for name, p in hf.named_parameters() if name.endswith("mlp.gate.weight")]
    prompt = [40, 41, 42, 43]

    async def scenario() -> tuple[GenerateResult, GenerateResult]:
        client = engine_client(url)
        [first] = await client.generate(prompt, GREEDY, return_routed_experts=True)
        try:
            await _push(client, [(name, -w) for name, w in gates], flush_cache=False)
            turn2 = prompt + first.output_ids + [50, 51]
            [second] = await client.generate(turn2, GREEDY, return_routed_experts=True)
        finally:
            await _push(client, gates, flush_cache=True)
        await client.close()
        return first, second

    first, second = run(scenario())
    cached = second.cached_tokens
    assert cached == len(prompt) + len(first.output_ids) - 1, "turn 1's forwarded tokens come from the cache"
    assert torch.equal(_rows(first), hf_routing(hf, prompt + first.output_ids))
    assert torch.equal(_rows(second)[:cached], _rows(first))
    unnegated = hf_routing(hf, prompt + first.output_ids + [50, 51] + second.output_ids)[cached:, 0]
    others = torch.ones(len(unnegated), 4).scatter_(1, unnegated.long(), 0).nonzero()[:, 1].view(-1, 2)
    assert torch.equal(_rows(second)[cached:, 0].sort(-1).values, others.int())


LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT, OTHER = [60, 61, 62], [70, 71, 72, 73]
"""Distinct prompts: the retracted request must not find the resumed one's tokens in the prefix cache."""


async def _wait_generating(client: EngineClient, before: int) -> None:
    while (await client.server_info())["embedded_stats"]["generated_tokens"] < before + 20:
        await asyncio.sleep(0.01)


def test_aborted_resumed_and_retracted_requests_return_one_requests_rows(
    url: str, hf: transformers.PreTrainedModel
) -> None:
    """A request the router resumes after a pause in abort mode (its continuation prefilled afresh) and one
    a pause in retract mode requeues (recomputed) each return the rows one uninterrupted request would."""

    async def paused_midway(mode: str, request: Any) -> GenerateResult:
        client = engine_client(url)
        before = (await client.server_info())["embedded_stats"]["generated_tokens"]
        task = asyncio.create_task(request)
        await _wait_generating(client, before)
        await client.pause_generation(mode)
        await client.continue_generation()
        [result] = await task
        await client.close()
        return result

    async def scenario() -> tuple[GenerateResult, GenerateResult]:
        router, client = Router([engine_client(url)], resume_aborted=True), engine_client(url)
        resumed = await paused_midway("abort", router.generate(PROMPT, LONG, return_routed_experts=True))
        retract = client.generate(OTHER, LONG, return_routed_experts=True, routed_experts_start_len=2)
        retracted = await paused_midway("retract", retract)
        await asyncio.gather(router.close(), client.close())
        return resumed, retracted

    resumed, retracted = run(scenario())
    assert resumed.num_resumes >= 1 and retracted.num_retractions >= 1
    assert len(resumed.output_ids) == len(retracted.output_ids) == LONG.max_new_tokens
    assert torch.equal(_rows(resumed), hf_routing(hf, PROMPT + resumed.output_ids))
    assert torch.equal(_rows(retracted), hf_routing(hf, OTHER + retracted.output_ids)[2:])


def test_training_rollouts_keep_the_moe_layers_routing_and_validation_asks_for_none(
    url: str, model_dir: Path, hf: transformers.PreTrainedModel
) -> None:
    """An agent worker under R3: a training rollout asks the engine for routed experts and its `routed_experts`
    column holds the two MoE layers only (the engine answers all three, the dense one 0), in int8 (4 experts), placed
    like `input_ids`; a validation rollout asks for none, so its batch has no column."""
    prompt_length, response_length = 8, 6
    settings = AgentSettings(
        rollout=RolloutConfig(),
        tokenizer_path=str(asset_path("tokenizer")),
        prompt_length=prompt_length,
        response_length=response_length,
        routing=RoutingLayout.of(str(model_dir)),
    )
    assert settings.routing is not None and settings.routing.moe_layers == (0, 2)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    rows = Batch.from_dict(non_tensors={"raw_prompt_ids": prompts})

    async def scenario() -> tuple[Batch, Batch]:
        worker = AgentWorker(settings, [url])
        try:
            (train, _), (val, _) = [await worker.rollout_rows(rows, validate, 0, 0) for validate in (False, True)]
        finally:
            await worker.close()
        return train, val

    train, val = run(scenario())
    assert "routed_experts" not in val, "validation rollouts ask the engines for no routing"
    column = train["routed_experts"]
    assert column.dtype == torch.int8 and column.shape == (2, prompt_length + response_length, 2 * TOP_K)
    for i, prompt in enumerate(prompts):
        tokens = train["input_ids"][i][train["attention_mask"][i].bool()].tolist()
        start, end = prompt_length - len(prompt), prompt_length - len(prompt) + len(tokens) - 1
        moe_only = hf_routing(hf, tokens)[:, [0, 2]].flatten(1)  # [tokens - 1, 2 MoE layers · k]
        assert torch.equal(column[i, start:end], moe_only.to(torch.int8)), i
        assert (column[i, :start] == NO_RECORD).all() and (column[i, end:] == NO_RECORD).all(), i
