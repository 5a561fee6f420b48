"""The embedded engine's classification mode (`--is-embedding`): a `*ForSequenceClassification` checkpoint (a
reward model) served through SGLang 0.5.23's `/classify`.

Protocol (read in the sglang==0.5.23 wheel): `srt/entrypoints/http_server.py::classify_request` parses the body as
`io_struct.EmbeddingReqInput` (`text` or `input_ids`, one prompt or a batch; `normalize_batch_and_arguments` refuses
neither and both, and gives a batch one rid each) and answers `{"embedding": [...], "meta_info": {...}}` per prompt,
a list for a batch (`tokenizer_manager.py::_handle_batch_output`, BatchEmbeddingOutput branch). A classifier's
`embedding` is its logits at the last token, one per label (`Pooler(PoolingType.LAST, normalize=False)` over the
`score` head, `srt/models/qwen2_classification.py`). Here: `getattr(model, base_model_prefix)` then `model.score` at
each prompt's last token, as transformers' GenericForSequenceClassification computes them.

What the engine consumes: `/classify` calls, queued. What it waits for: one worker thread runs the forwards. Each
turn of `Classifier._drain` forwards everything queued so far (rows sorted by length, `max_running_requests` a
forward) while later calls queue for the next turn, so concurrent requests share forwards; it ends when the queue
is empty and the next call starts it again. `close` stops the thread.
"""

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from aiohttp import web

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.classify_api import classify_reply
from megarl.engines.client.sglang_api import INITIAL_WEIGHT_VERSION, check_payload
from megarl.engines.embedded.engine import load_hf_model

HEALTH_TIMEOUT_S = 20.0
"""Like SGLang: unhealthy if the engine does not answer within this (http_server.py::health_generate)."""
NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. "
    "Please add `--is-embedding` when launching the server or try another model."
)
"""SGLang's answer to `/classify` on a generation server (tokenizer_manager.py::_validate_one_request)."""
NOT_GENERATION = "this engine serves a classifier (--is-embedding): POST /classify; it does not generate"


class BadRequest(ValueError):
    """Answered with HTTP 400 and this message."""


@dataclass(kw_only=True, slots=True)
class ClassifierArgs:
    model_path: str
    """HF `*ForSequenceClassification` checkpoint (config.json + safetensors)."""
    tokenizer_path: str | None = None
    """Tokenizer of `text` inputs; None = `model_path`'s."""
    device: str = "cpu"
    dtype: str = "auto"
    """auto (the checkpoint's) | float32 | bfloat16 | float16."""
    load_format: str = "auto"
    """auto (read the weights) | dummy (random weights)."""
    context_length: int | None = None
    """Longest prompt + 1; None = the model's max_position_embeddings."""
    max_running_requests: int = 64
    """Prompts forwarded together at most."""


class Classifier:
    """The model, its tokenizer and the worker thread that runs its forwards."""

    def __init__(self, args: ClassifierArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.model = _load_classifier(args, self.device)
        head = self.model.score
        assert isinstance(head, torch.nn.Module), "_load_classifier checked the score head"
        self.head: torch.nn.Module = head
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.context_length = args.context_length or int(self.model.config.max_position_embeddings)
        self.weight_version = INITIAL_WEIGHT_VERSION
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="embedded-classify")
        self._queue: list[tuple[list[list[int]], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.logits([[0]])  # warm up, as SGLang does before it answers health checks

    def logits(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's logits at its last token, [num_labels] each (run it on the worker thread)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[float]] = [[] for _ in prompts]
        for start in range(0, len(order), self.args.max_running_requests):
            rows = order[start : start + self.args.max_running_requests]
            for i, row in zip(rows, self._forward([prompts[i] for i in rows]), strict=True):
                out[i] = row
        return out

    @torch.no_grad()
    def _forward(self, prompts: list[list[int]]) -> list[list[float]]:
        """One right-padded forward: the causal mask keeps a row's real tokens from its padding."""
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)  # [b, s]
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()  # [b, s]
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        last = hidden.last_hidden_state[torch.arange(len(prompts)), lengths.to(self.device) - 1]  # [b, h]
        return self.head(last).float().cpu().tolist()  # [b, num_labels]

    async def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """`logits(prompts)`, forwarded with whatever else is queued."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((prompts, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return list(await future)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            taken, self._queue = self._queue, []
            flat = [prompt for prompts, _ in taken for prompt in prompts]
            try:
                logits = await loop.run_in_executor(self._thread, self.logits, flat)
            except Exception as error:  # a failed forward (e.g. out of memory) fails its calls, not the server
                _settle(taken, error=error)
                continue
            _settle(taken, logits=logits)

    async def ping(self) -> None:
        """Returns once the worker thread is free to run something."""
        await asyncio.get_running_loop().run_in_executor(self._thread, lambda: None)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def _settle(
    taken: list[tuple[list[list[int]], asyncio.Future]],
    *,
    logits: list[list[float]] | None = None,
    error: BaseException | None = None,
) -> None:
    """Hand each queued call its rows of `logits` (or the `error`); a call whose client left is skipped."""
    start = 0
    for prompts, future in taken:
        if future.done():
            pass
        elif error is not None:
            future.set_exception(error)
        else:
            assert logits is not None
            future.set_result(logits[start : start + len(prompts)])
        start += len(prompts)


def _load_classifier(args: ClassifierArgs, device: torch.device) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(args.model_path)
    if not any(name.endswith("ForSequenceClassification") for name in config.architectures or []):
        raise ValueError(
            f"--is-embedding: {args.model_path} is a {config.architectures}; the embedded engine classifies with "
            "*ForSequenceClassification checkpoints (a `score` head over the base model)"
        )
    auto = transformers.AutoModelForSequenceClassification
    model = load_hf_model(args.model_path, args.dtype, args.load_format, auto, device)
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        raise ValueError(f"--is-embedding: {type(model).__name__} has no `score` head over its base model")
    return model


@dataclass(kw_only=True, slots=True)
class ClassifyRequest:
    prompts: list[list[int]]
    rids: list[str]
    single: bool
    """One prompt, answered with one object (not a list)."""


def parse_classify(body: dict[str, Any], classifier: Classifier) -> ClassifyRequest:
    """A `/classify` body as io_struct.py::EmbeddingReqInput.normalize_batch_and_arguments and tokenizer_manager.py
    (_tokenize_texts, _validate_one_request) take it; BadRequest with SGLang's words where it refuses."""
    try:
        check_payload("/classify", body)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    text, ids = body.get("text"), body.get("input_ids")  # JSON: str or list[str]; list[int] or list[list[int]]
    if text is None and ids is None:
        raise BadRequest("At least one of text, input_ids, image, video, or audio should be provided")
    if text is not None and ids is not None:
        raise BadRequest("text and input_ids cannot be provided at the same time")
    if text is not None:
        single = isinstance(text, str)
        prompts = classifier.tokenizer([text] if single else list(text))["input_ids"]
    else:
        assert ids is not None, "one of the two is set"
        single = bool(ids) and not isinstance(ids[0], list)
        prompts = [ids] if single else ids
    _check_prompts(prompts, classifier.context_length)
    return ClassifyRequest(prompts=[list(p) for p in prompts], rids=_rids(body.get("rid"), len(prompts), single),
                           single=single)  # fmt: skip


def _check_prompts(prompts: Any, context_length: int) -> None:
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise BadRequest("input_ids must be a non-empty list of token ids, or a non-empty list of such lists")
    for prompt in prompts:
        if len(prompt) >= context_length:
            raise BadRequest(
                f"The input ({len(prompt)} tokens) is longer than the model's context length ({context_length} tokens)."
            )


def _rids(rid: Any, num_prompts: int, single: bool) -> list[str]:
    """One rid per prompt: the request's or fresh uuids (normalize_batch_and_arguments, _validate_rid_uniqueness)."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num_prompts)]
    if single:
        return [str(rid)]
    if not isinstance(rid, list) or len(rid) != num_prompts:
        raise BadRequest("The rid should be a list.")
    if len(set(rid)) != len(rid):
        duplicates = sorted({r for r in rid if rid.count(r) > 1})
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
    return [str(r) for r in rid]


class ClassifyServer:
    """The HTTP side of classification mode: `/classify` (and `/encode`, the same route in SGLang), health,
    readiness and info; `/generate` is refused."""

    def __init__(self, classifier: Classifier, keys: EngineKeys | None = None) -> None:
        self.classifier = classifier
        self.keys = keys or EngineKeys()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        routes = [
            ("*", "/classify", self.classify),
            ("*", "/encode", self.classify),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/ready", self.ready),
            ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.model_info),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info),
            ("*", "/generate", refuse_generation),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self.keys.allows(request.path, request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)  # srt/utils/auth.py::add_api_key_middleware
        try:
            return await handler(request)
        except ValueError as e:  # BadRequest too: a ValueError is a 400 (http_server.py::_create_error_response)
            return _error(str(e))

    async def classify(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        parsed = parse_classify(await request.json(), self.classifier)
        logits = await self.classifier.classify(parsed.prompts)
        latency, version = time.monotonic() - started, self.classifier.weight_version
        out = [
            classify_reply(rid, row, len(prompt), version, latency)
            for rid, row, prompt in zip(parsed.rids, logits, parsed.prompts, strict=True)
        ]
        return web.json_response(out[0] if parsed.single else out)

    async def health(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.classifier.ping(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503, text="engine thread did not answer")
        return web.Response(text="")

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        args = self.classifier.args
        info: dict[str, Any] = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path}
        info |= {"served_model_name": args.model_path, "is_generation": False, "load_format": args.load_format}
        return web.json_response(info | {"weight_version": self.classifier.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        info = {"args": asdict(self.classifier.args) | {"is_embedding": True}}
        return web.json_response(info | {"max_req_input_len": self.classifier.context_length - 1})


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def refuse_generation(request: web.Request) -> web.Response:
    """`/generate` on a classifier."""
    return _error(NOT_GENERATION)


async def refuse_classify(request: web.Request) -> web.Response:
    """`/classify` on a generation engine, answered as SGLang answers it."""
    return _error(NOT_EMBEDDING)


def serve(args: ClassifierArgs, keys: EngineKeys, host: str, port: int) -> None:
    """Load the classifier, then serve it until interrupted (the port opens once it has warmed up)."""
    classifier = Classifier(args)
    try:
        web.run_app(ClassifyServer(classifier, keys).app(), host=host, port=port, print=None)
    finally:
        classifier.close()
