"""The embedded engine on a CUDA device: greedy parity, CUDA IPC weight updates, sleep frees device memory (on CPU
under device_check.sh --dry: shared-memory updates, no device memory to count)."""

import asyncio
from pathlib import Path

import torch
from cases.engine_cases import (
    engine_client,
    hf_greedy,
    hf_logprobs,
    load_hf,
    randomize,
    run,
    save_engine_model,
    start_engine,
)
from gpu_cases import CUDA, needs_device, record

from megarl.engines.client.client import EngineClient
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.weights.tensor_handles import serialize_named_tensors

pytestmark = needs_device

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [42]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


async def _greedy_all(client: EngineClient) -> list:
    return [r[0] for r in await asyncio.gather(*(client.generate(p, GREEDY, return_logprob=True) for p in PROMPTS))]


def test_embedded_engine_on_cuda(tmp_path: Path) -> None:
    model_dir = save_engine_model(tmp_path / "model", hidden=1024, layers=4)
    device = "cuda:0" if CUDA else "cpu"
    server, url = start_engine(model_dir, tmp_path, "--device", device, "--enable-weights-cpu-backup")
    try:
        model = load_hf(model_dir).to(device)

        def check(results: list) -> None:
            for prompt, result in zip(PROMPTS, results, strict=True):
                assert result.output_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)
                expected = hf_logprobs(model, prompt, result.output_ids)
                torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)

        async def scenario() -> int:
            client = engine_client(url)
            check(await _greedy_all(client))
            for seed in (1, 2):  # CUDA IPC handles, twice
                randomize(model, seed)
                named = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
                await client.begin_weight_update()
                await client.update_weights_from_tensor([serialize_named_tensors(named)])
                await client.end_weight_update()
                check(await _greedy_all(client))
            free_before = torch.cuda.mem_get_info()[0] if CUDA else 0
            await client.release_memory_occupation()
            freed = torch.cuda.mem_get_info()[0] - free_before if CUDA else 0
            await client.resume_memory_occupation()
            check(await _greedy_all(client))
            await client.close()
            return freed

        weight_bytes = sum(p.numel() * 4 for p in model.parameters())
        freed = run(scenario())
        record("embedded_engine/release", freed_bytes=freed, weight_bytes=weight_bytes)
        assert freed > 0.8 * weight_bytes or not CUDA
    finally:
        server.stop()
