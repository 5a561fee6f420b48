"""Helpers for tests that run the embedded engine as a real server process."""

import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import ClientTimeouts, EngineClient
from megarl.engines.client.fleet import Fleet
from megarl.engines.client.router import Router
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.client.sglang_api import GenerateResult
from megarl.engines.replicas.server_process import ServerProcess
from megarl.ports import free_port

ASSET_CONFIG = Path(__file__).resolve().parents[2] / "megarl/assets/models/tiny_dense/config.json"
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def engine_client(url: str, keys: EngineKeys | None = None, timeouts: ClientTimeouts | None = None) -> EngineClient:
    """One engine's client, as a run's `Fleet` makes it."""
    return Fleet.connect([url], keys, timeouts).clients[0]


def router_of(
    urls: list[str], keys: EngineKeys | None = None, sticky_capacity: int = 100_000, resume_aborted: bool = False
) -> Router:
    """A router over fresh clients of `urls` with default timeouts."""
    clients = Fleet.connect(urls, keys).clients
    return Router(clients, sticky_capacity=sticky_capacity, resume_aborted=resume_aborted)


async def generate_batch(
    router: Router, prompts: list[list[int]], sampling: SamplingParams, return_logprob: bool = False
) -> list[list[GenerateResult]]:
    """Single-turn: `sampling.n` samples for every prompt, all in flight at once, results in prompt order."""
    return list(await asyncio.gather(*(router.generate(p, sampling, return_logprob) for p in prompts)))


def write_engine_config(path: Path, hidden: int = 256, layers: int = 4) -> Path:
    """tiny_dense's config.json widened to `hidden` and `layers` (no weights: a dummy-load engine needs none)."""
    config = json.loads(ASSET_CONFIG.read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention"] * layers,
        max_window_layers=layers,
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def save_engine_model(path: Path, seed: int = 0, hidden: int = 256, layers: int = 4) -> Path:
    """tiny_dense widened to ~6M parameters (24 MB fp32), so releasing weights shows in RSS."""
    write_engine_config(path, hidden, layers)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    randomize(model, seed)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights giving O(1) logits, so greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.2 * (2 * torch.rand(param.shape, generator=g) - 1))
        elif name.endswith("bias"):
            param.copy_(0.2 * (2 * torch.rand(param.shape, generator=g) - 1))
        else:
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)


def load_hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(
    model: transformers.PreTrainedModel, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / temperature) of each output token, from one full forward pass."""
    ids = torch.tensor([prompt + output], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def start_engine(model_dir: Path, log_dir: Path, *extra: str) -> tuple[ServerProcess, str]:
    """An embedded engine process on a free port, healthy; returns it and its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "megarl.engines.embedded", "--model-path", str(model_dir), "--port", str(port)]
    server = ServerProcess([*command, *extra], log_path=log_dir / f"engine_{port}.log", env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(url + "/health_generate", timeout_s=120)
    except Exception:
        server.stop()
        raise
    return server, url
