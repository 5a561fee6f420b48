"""The `rm` reward source on servers: a discriminative RM served by SGLang `/classify` replicas (or the embedded
engine's `--is-embedding` mode), one request per finished trajectory.

What it sends (SGLang 0.5.23 `srt/entrypoints/http_server.py::classify_request`, body `io_struct.EmbeddingReqInput`):
`{"input_ids": [...]}` for one prompt, the conversation as `rm_token_ids` renders it. What it reads: the reply
`{"embedding": [logit, ...], "meta_info": {...}}` (`tokenizer_manager.py::_handle_batch_output`, the
`BatchEmbeddingOutput` branch), whose `embedding` holds the classifier's logits at the last token (the models'
`Pooler(PoolingType.LAST, normalize=False)`, e.g. `srt/models/qwen2_classification.py`); the score is logit 0.

Requests go through `remote.post_json` (HTTP 429 and 5xx retried, other answers final), as the judge's and the
reward service's do. The engine side's schema is `sglang_api.REQUEST_FIELDS["/classify"]`;
tests/dist/test_sglang_classify_contract.py checks `classify_payload` against both.
"""

import asyncio
import itertools
from typing import Any, Protocol

import aiohttp
import transformers

from megarl.config.reward import DiscriminativeRMConfig
from megarl.rewards.formatting import rm_token_ids
from megarl.rewards.retry import Transient, with_retries
from megarl.rewards.sources import Component, Trajectory
from megarl.scoring.remote import new_session, post_json

CLASSIFY_PATH = "/classify"


class BearerKeys(Protocol):
    """What the source reads of `megarl.engines.client.auth.EngineKeys`: `/classify` takes SGLang's `--api-key`
    (a NORMAL endpoint in `srt/utils/auth.py::decide_request_auth`)."""

    @property
    def api(self) -> str | None: ...


def classify_payload(input_ids: list[int]) -> dict[str, Any]:
    """The `/classify` body for one prompt (a single prompt is answered with one object, not a list)."""
    return {"input_ids": list(input_ids)}


def reply_score(reply: Any) -> float:
    """Logit 0 of a single-prompt `/classify` reply (`Transient` if it is not one: a proxy's page, a bad server)."""
    try:
        return float(reply["embedding"][0])
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise Transient(f"not a /classify reply ({type(error).__name__}: {error}): {str(reply)[:200]}") from error


class ClassifierSource:
    """Scores a trajectory with a discriminative RM behind `urls` (round robin, one URL per try), at most
    `cfg.concurrency` requests in flight; each try within `cfg.retry.timeout_s`. Connection errors, timeouts, 5xx
    and 429 are tried again (`cfg.retry`); another 4xx fails at once."""

    name = "rm"

    def __init__(
        self,
        cfg: DiscriminativeRMConfig,
        urls: list[str],
        keys: BearerKeys | None = None,
        tokenizer: transformers.PreTrainedTokenizerBase | None = None,
    ) -> None:
        if not urls:
            raise ValueError("ClassifierSource needs the /classify servers' URLs (reward_model.discriminative.engines)")
        if tokenizer is None and not (cfg.tokenizer_path or cfg.path):
            raise ValueError("reward_model.discriminative.path (or tokenizer_path) names the RM's tokenizer")
        self.cfg = cfg
        self.urls = [url.rstrip("/") for url in urls]
        self.tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.path)
        key = None if keys is None else keys.api
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._turn = itertools.count()
        self._limit = asyncio.Semaphore(cfg.concurrency)
        self._session: aiohttp.ClientSession | None = None

    def token_ids(self, trajectory: Trajectory) -> list[int]:
        """What the RM reads of `trajectory` (`rm_token_ids` with this RM's template and budget)."""
        return rm_token_ids(self.tokenizer, trajectory.messages, self.cfg.max_length, self.cfg.chat_template_kwargs)

    async def score(self, trajectory: Trajectory) -> Component:
        ids = self.token_ids(trajectory)
        async with self._limit:
            value, retries = await with_retries(
                lambda: self._classify(ids), self.cfg.retry, f"rm score of sample {trajectory.sample_id!r}"
            )
        return Component(value=value, retries=retries)

    async def _classify(self, ids: list[int]) -> float:
        url = self.urls[next(self._turn) % len(self.urls)] + CLASSIFY_PATH
        if self._session is None or self._session.closed:
            self._session = new_session()
        return reply_score(await post_json(self._session, url, classify_payload(ids), self._headers))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
