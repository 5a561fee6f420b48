"""The embedded engine's input log-probs (SGLang's logprob_start_len; prefill-only requests, max_new_tokens 0): what
an on-policy distillation teacher reads, through megarl's prefill client, against transformers' own forward."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import transformers
from cases.engine_cases import hf_logprobs, load_hf, run, save_engine_model, start_engine

from megarl.assets import asset_path
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.prefill_api import PrefillLogProbs, prefill_body, prefill_log_probs, response_log_probs
from megarl.engines.replicas.server_process import ServerProcess

KEYS = EngineKeys(api="teacher-key")
HEADERS = {"Authorization": f"Bearer {KEYS.api}"}
TOP_K = 4
CHATS = [("What is 2 + 3?", "2 + 3 = 5."), ("Name a prime.", "7"), ("Hi", "Hello! How can I help you today?")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_model(tmp_path_factory.mktemp("teacher") / "model", hidden=64, layers=2)


@pytest.fixture(scope="module")
def url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server: ServerProcess
    server, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--api-key", str(KEYS.api))
    yield url
    server.stop()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> transformers.PreTrainedModel:
    return load_hf(model_dir)


def _pairs() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of CHATS in the shipped tokenizer's words."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("tokenizer"))
    return [(tokenizer.encode(q), tokenizer.encode(a)) for q, a in CHATS]


@torch.no_grad()
def _hf_rows(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of the raw logits, [len(ids), v]: row i is the distribution of token i + 1."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] = HEADERS) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body, headers=headers) as r:
        return r.status, await (r.json() if r.content_type == "application/json" else r.text())


def _values(entries: list[Any]) -> torch.Tensor:
    return torch.tensor([e[0] for e in entries])


def test_prefill_scores_equal_transformers(url: str, hf: transformers.PreTrainedModel) -> None:
    """Concurrent teacher calls: each response token's log-prob and the top-k at its position, as transformers
    computes them on the whole sequence (log_softmax, gather, topk)."""
    pairs = _pairs()

    async def score() -> list[PrefillLogProbs]:
        async with aiohttp.ClientSession() as session:
            calls = (prefill_log_probs(session, url, KEYS, p + r, len(p), TOP_K) for p, r in pairs)
            return list(await asyncio.gather(*calls))

    for (prompt, response), got in zip(pairs, run(score()), strict=True):
        rows = _hf_rows(hf, prompt + response)[len(prompt) - 1 : -1]  # [R, v]
        assert got.token_ids == response and len(got.logprobs) == len(response)
        expected = rows.gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.logprobs), expected, atol=1e-5, rtol=0)
        values, ids = rows.topk(TOP_K, dim=-1)
        assert got.top_ids == ids.tolist()
        torch.testing.assert_close(torch.tensor(got.top_logprobs), values, atol=1e-5, rtol=0)


def test_prefill_reply_has_sglangs_fields(url: str, hf: transformers.PreTrainedModel) -> None:
    """A prefill-only reply as SGLang builds it: no output ids, finish length 0, input entries from
    logprob_start_len with a null first, one output top-k entry (the last position's); no key, no answer."""
    prompt, response = _pairs()[0]
    status, reply = run(_post(url, prefill_body(prompt + response, len(prompt), TOP_K)))
    assert status == 200, reply
    meta = reply["meta_info"]
    assert reply["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(prompt + response)
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    assert meta["input_token_logprobs"][0] == [None, prompt[-1], None] and meta["input_top_logprobs"][0] is None
    assert [e[1] for e in meta["input_token_logprobs"][1:]] == response
    rows = _hf_rows(hf, prompt + response)
    [last] = meta["output_top_logprobs"]
    values, ids = rows[-1].topk(TOP_K)
    assert [e[1] for e in last] == ids.tolist()
    torch.testing.assert_close(_values(last), values, atol=1e-5, rtol=0)
    aligned = response_log_probs(meta, len(prompt), len(response))
    assert aligned.token_ids == response and aligned.top_ids is not None and len(aligned.top_ids) == len(response)
    status, _ = run(_post(url, prefill_body(prompt, 1), headers={}))
    assert status == 401


def test_generation_with_input_logprobs_and_refusals(url: str, hf: transformers.PreTrainedModel) -> None:
    """logprob_start_len with generation: input entries of raw logits (no temperature), output ones at the sampling
    temperature; a start past the prompt is refused in SGLang's words unless return_logprob is off; the prompt's
    length gives no entries; a batch takes one start per prompt."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    sampling = {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 2}
    status, reply = run(_post(url, body | {"top_logprobs_num": 3, "token_ids_logprob": [1, 2]}))
    assert status == 200, reply
    meta, rows = reply["meta_info"], _hf_rows(hf, prompt)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[2:] and entries[0][0] is None
    expected = rows[2:-1].gather(-1, torch.tensor(prompt[3:])[:, None])[:, 0]
    torch.testing.assert_close(_values(entries[1:]), expected, atol=1e-5, rtol=0)
    assert [[e[1] for e in top] for top in meta["input_top_logprobs"][1:]] == rows[2:-1].topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor([[e[0] for e in p] for p in meta["input_token_ids_logprobs"][1:]]),
                               rows[2:-1, [1, 2]], atol=1e-5, rtol=0)  # fmt: skip
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    output = reply["output_ids"]
    assert len(output) == 5 and len(meta["output_top_logprobs"]) == 5
    sampled = hf_logprobs(hf, prompt, output, temperature=0.7)
    torch.testing.assert_close(_values(meta["output_token_logprobs"]), sampled, atol=1e-5, rtol=0)

    status, refusal = run(_post(url, body | {"logprob_start_len": len(prompt) + 1}))
    assert status == 400 and refusal["error"]["message"] == (
        f"req.logprob_start_len={len(prompt) + 1} is higher than the number of input tokens "
        f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller logprob_start_len."
    )
    status, _ = run(_post(url, body | {"logprob_start_len": len(prompt) + 1, "return_logprob": False}))
    assert status == 200
    status, reply = run(_post(url, body | {"logprob_start_len": len(prompt), "top_logprobs_num": 2}))
    assert reply["meta_info"]["input_token_logprobs"] == [] and reply["meta_info"]["input_top_logprobs"] == []
    batch = {"input_ids": [prompt, prompt[:4]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    status, replies = run(_post(url, batch | {"logprob_start_len": [5, 0]}))
    assert status == 200 and [len(r["meta_info"]["input_token_logprobs"]) for r in replies] == [4, 4]
