"""The embedded engine's classification mode (`--is-embedding`) as a separate process: a reward model's scores
through the `rm` source (`ClassifierSource`: the RM's chat template, truncation, `/classify`, keys, concurrency) and
through `EngineClient.classify`, against transformers' `AutoModelForSequenceClassification`."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from cases.engine_cases import engine_client, run, start_engine
from cases.reward_cases import save_classifier

from megarl.config.reward import DiscriminativeRMConfig, RetryConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import EngineError
from megarl.engines.replicas.server_process import ServerProcess
from megarl.rewards.sources import Component, RewardSourceError, Trajectory
from megarl.scoring.classify import ClassifierSource

KEYS = EngineKeys(api="rm-api-key", admin="rm-admin-key")
MAX_LENGTH = 40
"""Tokens the RM reads: the long conversation below is cut to its last 40."""
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 6."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a prime number larger than ten, and say why it is prime. " * 3},
        {"role": "assistant", "content": "Thirteen: no whole number but one and itself divides it."},
    ],
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_classifier(tmp_path_factory.mktemp("rm") / "model")


@pytest.fixture(scope="module")
def engine(rm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    extra = ["--is-embedding", "--dtype", "float32", "--max-running-requests", "2"]  # 2: a batch takes two forwards
    server, url = start_engine(rm_dir, tmp_path_factory.mktemp("logs"), *extra, "--api-key", KEYS.api or "")
    yield server, url
    server.stop()


def _trajectory(messages: list[dict], i: int) -> Trajectory:
    return Trajectory(
        data_source="test",
        messages=messages,
        prompt_messages=messages[:-1],
        response_text=messages[-1]["content"],
        ground_truth="",
        sample_id=f"s{i}",
    )


@torch.no_grad()
def _transformers_scores(rm_dir: Path) -> list[float]:
    """Each conversation through the tokenizer's own chat template (tokenized by it), its last MAX_LENGTH tokens,
    one unpadded forward of AutoModelForSequenceClassification: the logit at the last token."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    scores = []
    for messages in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)["input_ids"]
        scores.append(float(model(torch.tensor([ids[-MAX_LENGTH:]])).logits[0, 0]))
    return scores


async def _source_scores(cfg: DiscriminativeRMConfig, url: str, keys: EngineKeys | None) -> list[Component]:
    source = ClassifierSource(cfg, [url, url + "/"], keys)
    try:
        return list(await asyncio.gather(*(source.score(_trajectory(m, i)) for i, m in enumerate(CONVERSATIONS))))
    finally:
        await source.close()


async def _client_scores(url: str, keys: EngineKeys | None, prompts: list[list[int]]) -> list[float]:
    client = engine_client(url, keys)
    try:
        return await client.classify(prompts)
    finally:
        await client.close()


def test_scores_equal_transformers_logits(engine: tuple[ServerProcess, str], rm_dir: Path) -> None:
    cfg = DiscriminativeRMConfig(enable=True, path=str(rm_dir), backend="server", max_length=MAX_LENGTH, concurrency=2)
    expected = _transformers_scores(rm_dir)
    assert len(set(expected)) == len(expected)  # the RM tells the conversations apart
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_dir)
    long_ids = tokenizer.apply_chat_template(CONVERSATIONS[2], tokenize=True)["input_ids"]
    assert len(long_ids) > MAX_LENGTH  # the truncation is exercised
    components = run(_source_scores(cfg, engine[1], KEYS))
    assert [c.retries for c in components] == [0, 0, 0]
    assert [c.value for c in components] == pytest.approx(expected, abs=1e-4)
    source = ClassifierSource(cfg, [engine[1]])
    prompts = [source.token_ids(_trajectory(m, i)) for i, m in enumerate(CONVERSATIONS)]
    batch = run(_client_scores(engine[1], KEYS, prompts))  # one batch request: answered as a list, in prompt order
    assert batch == pytest.approx(expected, abs=1e-4)


def test_a_refused_request_fails_at_once(engine: tuple[ServerProcess, str], rm_dir: Path) -> None:
    """Without the key the server answers 401, which no retry mends: the source fails on its first try; the
    client names the HTTP status."""
    retry = RetryConfig(max_retries=3, backoff_s=5.0)
    cfg = DiscriminativeRMConfig(enable=True, path=str(rm_dir), backend="server", retry=retry)
    with pytest.raises(RewardSourceError, match="HTTP 401") as failed:
        run(_source_scores(cfg, engine[1], None))
    assert failed.value.retries == 0
    with pytest.raises(EngineError, match="HTTP 401"):
        run(_client_scores(engine[1], None, [[1, 2, 3]]))
