"""LoRA adapters served by the embedded engine (SGLang's --enable-lora), loaded and named through megarl's client and
router, checked against peft's own model."""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import peft
import pytest
import safetensors.torch
import torch
from aiohttp import web
from cases.engine_cases import engine_client, hf_logprobs, load_hf, router_of, run, save_engine_model, start_engine

from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.lora_server import NOT_ENABLED
from megarl.engines.embedded.server import EngineServer
from megarl.engines.weights.adapters import adapter_entries
from megarl.ports import free_port

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [42]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
Adapter = tuple[peft.PeftModel, dict[str, Any], list[tuple[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_model(tmp_path_factory.mktemp("engine") / "model")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    """Two rank-4 adapters with random A and B, as PEFT saves them: the peft model, adapter_config.json, tensors."""
    out = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = peft.get_peft_model(load_hf(model_dir), config).eval()
        folder = tmp_path_factory.mktemp(f"adapter{seed}")
        model.save_pretrained(folder)
        named = list(safetensors.torch.load_file(folder / "adapter_model.safetensors").items())
        out[f"v{seed}"] = (model, json.loads((folder / "adapter_config.json").read_text()), named)
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "qkv_proj", "o_proj", "down_proj"]
    server, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"), *lora)
    yield url
    server.stop()


async def _load(url: str, adapters: dict[str, Adapter], names: dict[str, str]) -> None:
    """Load adapter `names[key]` from `adapters[key]` for each key."""
    client = engine_client(url)
    for key, name in names.items():
        _, config, named = adapters[key]
        await client.load_lora_adapter_from_tensors(name, config, adapter_entries(named))
    await client.close()


async def _error(call: Any) -> str:
    with pytest.raises(EngineError) as refused:
        await call
    return str(refused.value)


def _check_logprobs(model: torch.nn.Module, prompt: list[int], result: GenerateResult) -> None:
    assert result.output_logprobs is not None and len(result.output_ids) == GREEDY.max_new_tokens
    expected = hf_logprobs(model, prompt, result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)


def test_adapters_match_peft_per_request_and_unload(engine: str, model_dir: Path, adapters: dict[str, Adapter]) -> None:
    """Base, v1 and v2 requests batched together each get their own model's log-probs; a batched body names one adapter
    per prompt; bad adapters (and tensors that miss their expected_checksums) are refused; an unloaded adapter can no
    longer be named."""
    run(_load(engine, adapters, {"v1": "v1", "v2": "v2"}))
    chosen = [None, "v1", "v2"]

    async def scenario() -> tuple[list[list[GenerateResult]], list[dict], list[str], dict]:
        client = engine_client(engine)
        calls = [client.generate(p, GREEDY, True, lora_path=name) for name in chosen for p in PROMPTS]
        results = list(await asyncio.gather(*calls))
        _, config, named = adapters["v1"]
        body = {"input_ids": PROMPTS[:2], "sampling_params": GREEDY.to_json(), "lora_path": ["v2", None]}
        wrong = {"lora_name": "sum", "config_dict": config, "serialized_named_tensors": adapter_entries(named)}
        wrong["expected_checksums"] = {name: "0" * 64 for name, _ in named}
        async with aiohttp.ClientSession() as session:
            async with session.post(engine + "/generate", json=body) as reply:
                batched = await reply.json()
            async with session.post(engine + "/load_lora_adapter_from_tensors", json=wrong) as reply:
                checksums = f"{reply.status} {await reply.text()}"
        errors = [
            await _error(client.load_lora_adapter_from_tensors(name, cfg, adapter_entries(tensors)))
            for name, cfg, tensors in (
                ("v1", config, named),
                ("big", dict(config, r=16), named),
                ("moe", config, [_renamed(named, "mlp.experts.0")]),
                ("up", config, [_renamed(named, "mlp.up_proj")]),
            )
        ]
        await client.unload_lora_adapter("v1")
        errors += [await _error(client.generate(PROMPTS[0], GREEDY, lora_path="v1")), checksums]
        info = await client.server_info()
        await client.close()
        return results, batched, errors, info

    results, batched, errors, info = run(scenario())
    models = {None: load_hf(model_dir), "v1": adapters["v1"][0], "v2": adapters["v2"][0]}
    for i, name in enumerate(chosen):
        for prompt, [result] in zip(PROMPTS, results[3 * i : 3 * i + 3], strict=True):
            _check_logprobs(models[name], prompt, result)
    assert [r[0].output_ids for r in results[:3]] != [r[0].output_ids for r in results[3:6]]  # v1 changes the model
    assert [b["output_ids"] for b in batched] == [results[6][0].output_ids, results[1][0].output_ids]
    assert "Failed to load LoRA adapter v1 because it is already loaded" in errors[0]
    assert "has rank 16, above --max-lora-rank 8" in errors[1]
    assert "targets MoE experts" in errors[2] and "outside --lora-target-modules" in errors[3]
    assert "HTTP 400" in errors[4] and "requested LoRA adapters are not loaded: v1" in errors[4]
    assert errors[5].startswith("400 ") and "do not match expected_checksums" in errors[5]
    assert info["lora_adapters"] == ["v2"]


def _renamed(named: list[tuple[str, torch.Tensor]], module: str) -> tuple[str, torch.Tensor]:
    """The first tensor moved to layer 0's `module` (e.g. an expert's projection, a projection not served)."""
    return f"base_model.model.model.layers.0.{module}.lora_A.weight", named[0][1]


def test_router_unloads_a_retired_adapter_after_its_last_request(engine: str, adapters: dict[str, Adapter]) -> None:
    """A request naming r1 waits at a paused engine while the router switches to r2, then to the base (r1 is now
    the adapter before the previous: retired), then back to r2: r1 stays loaded until that request has answered
    (with r1's tokens), then the router unloads it; new requests name r2."""
    run(_load(engine, adapters, {"v1": "r1", "v2": "r2"}))

    async def scenario() -> tuple[list[GenerateResult], list[str], list[str]]:
        client, router = engine_client(engine), router_of([engine])
        expected = [(await client.generate(PROMPTS[1], GREEDY, lora_path=name))[0] for name in ("r1", "r2")]
        router.use_adapter("r1")
        await client.pause_generation()
        held = asyncio.create_task(router.generate(PROMPTS[1], GREEDY))
        await asyncio.sleep(0.2)
        router.use_adapter("r2")
        router.use_adapter(None)  # r1 retired, one switch after it stopped being current
        await asyncio.sleep(0.3)  # time for a wrong unload
        while_held = (await client.server_info())["lora_adapters"]
        router.use_adapter("r2")
        await client.continue_generation()
        [result] = await held
        await router.retirements()
        after = (await client.server_info())["lora_adapters"]
        [later] = await router.generate(PROMPTS[1], GREEDY)
        await router.close()
        await client.close()
        return [*expected, result, later], while_held, after

    (r1, r2, held, later), while_held, after = run(scenario())
    assert r1.output_ids != r2.output_ids
    assert "r1" in while_held and held.output_ids == r1.output_ids
    assert "r1" not in after and "r2" in after and later.output_ids == r2.output_ids


def test_lora_needs_enable_lora(model_dir: Path, adapters: dict[str, Adapter]) -> None:
    """An engine started without --enable-lora refuses adapters, and requests naming one, in SGLang's words."""
    plain = EmbeddedEngine(EngineArgs(model_path=str(model_dir)))
    _, config, named = adapters["v1"]

    async def scenario() -> list[str]:
        runner = web.AppRunner(EngineServer(plain).app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = engine_client(f"http://127.0.0.1:{port}")
        errors = [
            await _error(client.load_lora_adapter_from_tensors("v1", config, adapter_entries(named))),
            await _error(client.generate(PROMPTS[0], GREEDY, lora_path="v1")),
        ]
        await client.close()
        await runner.cleanup()
        return errors

    try:
        load, generate = run(scenario())
    finally:
        plain.shutdown()
    assert "HTTP 400" in load and NOT_ENABLED in load
    assert "LoRA adapter 'v1' was requested, but LoRA is not enabled" in generate
