"""Tiny reward models for the reward tests: a Qwen2 sequence classifier (num_labels=1) and a judge, both saved with
the shipped tokenizer so one path serves as model and tokenizer."""

import asyncio
import contextlib
import json
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from aiohttp import web

from megarl.assets import asset_path
from megarl.ports import free_port
from megarl.rewards import RewardResult


def _config(num_labels: int | None) -> dict:
    config = json.loads((asset_path("models/tiny_dense") / "config.json").read_text())
    if num_labels is None:
        return config
    return config | {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": num_labels}


def _with_tokenizer(path: Path) -> None:
    for file in asset_path("tokenizer").iterdir():
        shutil.copy(file, path / file.name)


def save_classifier(path: Path, seed: int = 0) -> Path:
    """A tiny random `Qwen2ForSequenceClassification` (hidden 64, 2 layers, one label, pad id 0) and the shipped
    tokenizer at `path`; its scores are O(1) and differ between sequences."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(num_labels=1)))
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(transformers.AutoConfig.from_pretrained(path))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2 if name.startswith("score") else 0.05)
    model.save_pretrained(path)
    _with_tokenizer(path)
    return path


def save_judge(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 causal LM and the shipped tokenizer at `path` (a judge whose replies are noise)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(num_labels=None)))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    model.save_pretrained(path)
    _with_tokenizer(path)
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number larger than ten and say why it is prime."},
        {"role": "assistant", "content": "13: no number between 2 and 12 divides it."},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [{"role": "user", "content": "Sort 3, 1, 2."}, {"role": "assistant", "content": "1, 2, 3"}],
]
"""Conversations of different lengths for the RM to score."""


def rm_rows(model_dir: Path, keep_last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rm_input_ids`, `rm_attention_mask`) `[b, L]` of `CONVERSATIONS` in the RM's chat template, left-padded with
    its pad id; `keep_last`: each conversation cut to its last `keep_last` tokens first."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rows = [list(tokenizer.apply_chat_template(c, tokenize=True)["input_ids"]) for c in CONVERSATIONS]
    rows = [row[-keep_last:] if keep_last else row for row in rows]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def hf_classifier_scores(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' classifier on left-padded rows (positions from the mask): its logits `[b]` (its own choice of
    the last non-pad token) and the score head's output at every position `[b, L]`."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, attn_implementation="eager")
    model = model.float()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0]
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    return logits, model.score(hidden)[..., 0]


def rank_rm_scores(
    model_dir: Path, cases: list[tuple[str, object, int]], ids: torch.Tensor, mask: torch.Tensor, device: str = "cpu"
) -> dict[str, object]:
    """On every rank: for each (name, `MegatronConfig`, max_length), a `RewardModelWorker` (offloading) on `device`
    set up and scoring the rows; the first also after `release()` (its bytes freed) and `restore()`."""
    from megarl.batch import Batch
    from megarl.config.model import ModelConfig
    from megarl.megatron.inputs import MicroBatching
    from megarl.workers.reward_model import RewardModelWorker
    from megarl.workers.settings import ModelSettings, RewardModelSettings

    batch = Batch.from_dict({"rm_input_ids": ids, "rm_attention_mask": mask})
    out: dict[str, object] = {}
    for name, megatron, max_length in cases:
        worker = RewardModelWorker(torch.distributed.get_rank(), torch.distributed.get_world_size(), device)
        model = ModelSettings(
            model=ModelConfig(path=str(model_dir), dtype="float32"),
            megatron=megatron,  # type: ignore[arg-type]
            weights_path=str(model_dir),
            seed=5,
            value_head=True,
        )
        worker.setup(RewardModelSettings(model=model, micro=MicroBatching(3), max_length=max_length, offload=True))
        out[name] = worker.compute_rm_scores(batch)["rm_scores"].cpu()
        if name == cases[0][0]:
            out["released_bytes"] = worker.release()["offload/bytes"]
            worker.restore()
            out[f"{name}+restored"] = worker.compute_rm_scores(batch)["rm_scores"].cpu()
    return out


def slow_rule(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
    """A rule reward that holds the GIL in one C call for about half a second (no thread runs meanwhile), then
    scores the response's digits summed."""
    sum(range(30_000_000))
    return RewardResult(float(sum(int(c) for c in solution_str if c.isdigit())))


class FlakyService:
    """A reward service on loopback: 500 on a seeded 20% of POSTs, else `len(response) % 5 / 4`; `scored` holds the
    sample ids it answered, `failures` counts the 500s."""

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.failures = 0
        self.scored: set[str] = set()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.rng.random() < 0.2:
            self.failures += 1
            return web.Response(status=500, text="flaky")
        self.scored.add(body["sample_id"])
        return web.json_response({"score": len(body["response"]) % 5 / 4})


async def _answer_probe(_: web.Request) -> web.Response:
    return web.Response(text="POST here")  # the gate's reachability check


@contextlib.contextmanager
def serve_flaky() -> Iterator[FlakyService]:
    """A `FlakyService` served from a thread of this process while the context lasts."""
    flaky, loop = FlakyService(), asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/score", flaky.handle)
    app.router.add_get("/score", _answer_probe)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", flaky.port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield flaky
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
