"""The embedded engine's core: one thread that owns the model and runs continuous batching.

What it consumes: sequences from `submit` and control functions from `call`, both thread-safe.
What it waits for: a condition variable, signalled by either, when it has nothing to run.
Each turn of the loop runs the queued control functions (between steps, so they never race a
forward pass), ends aborted rows, admits waiting sequences up to `max_running_requests` with one
batched prefill, then runs one decode step over every running row. Finished sequences are handed
to their callbacks. While `paused` (a pause in retract or in_place mode) a turn only runs controls and
ends aborted sequences; `set_paused(False)` (continue) unblocks it. `shutdown` ends the loop; requests
still queued are aborted.
"""

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers

from megarl.engines.client.sglang_api import (
    ABORTED,
    ABORTED_WAITING,
    INITIAL_WEIGHT_VERSION,
    MEMORY_TAGS,
    FinishReason,
    version_spans,
)
from megarl.engines.embedded.batch import KVBatch, Sequence, eos_ids
from megarl.engines.embedded.prefill import score_admitted
from megarl.engines.embedded.routing import RoutingRecorder
from megarl.engines.embedded.row_batch import make_batch, prefix_cache
from megarl.engines.embedded.sampler import RowSampling
from megarl.engines.embedded.vision import auto_model_class, load_vision
from megarl.engines.embedded.weights import (
    ReleasedWeights,
    free_memory,
    keep_fp32,
    release_weights,
    restore_weights,
)

if TYPE_CHECKING:
    from megarl.engines.embedded.lora import EngineAdapters

logger = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True)
class EngineArgs:
    model_path: str
    """HF model directory (config.json + safetensors)."""
    tokenizer_path: str | None = None
    """Where a vision-language model's image processor is looked for after model_path (preprocessor_config.json)."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    dtype: str = "auto"
    """auto (the checkpoint's) | float32 | bfloat16 | float16."""
    load_format: str = "auto"
    """auto (read the weights) | dummy (random weights; a weight sync fills them)."""
    context_length: int | None = None
    """Prompt + output tokens at most; None = the model's max_position_embeddings."""
    max_running_requests: int = 64
    """Rows decoded together at most."""
    random_seed: int = 0
    """Seeds requests that carry no sampling_seed."""
    enable_weights_cpu_backup: bool = False
    """Keep weight values across release/resume (on disk for a CPU engine, host memory for CUDA)."""
    prefix_cache_tokens: int = 32768
    """Tokens of finished sequences whose KV is kept for reuse by later prompts; 0 = no prefix cache."""
    enable_deterministic_inference: bool = False
    """Batch-invariant: each sequence decoded alone, no prefix cache (row_batch.py); seeded requests repeat exactly."""
    enable_return_routed_experts: bool = False
    """Record the experts each MoE layer routes every token to, for requests with return_routed_experts (R3)."""
    enable_lora: bool = False
    """Serve LoRA adapters loaded through /load_lora_adapter_from_tensors, per request (`lora_path`)."""
    max_lora_rank: int | None = None
    """The highest adapter rank taken; required with enable_lora."""
    lora_target_modules: list[str] | None = None
    """The projections adapters may target (HF names, SGLang's qkv_proj / gate_up_proj, or all); required with
    enable_lora."""


@dataclass(kw_only=True, slots=True)
class EngineStats:
    decode_steps: int = 0
    prefill_batches: int = 0
    prefill_tokens: int = 0
    """Prompt tokens (with the output so far, after a retraction) run through the model, cached prefixes excluded."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    generated_tokens: int = 0
    max_batch_size: int = 0
    batch_size_histogram: dict[int, int] = field(default_factory=dict)
    """Decode steps by number of rows."""


class EmbeddedEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        model_class = auto_model_class(args.model_path)  # image-text-to-text for a vision-language model
        self.model = load_hf_model(args.model_path, args.dtype, args.load_format, model_class, self.device)
        text_config = self.model.config.get_text_config()  # a vision-language model's language model's
        self.context_length = args.context_length or int(text_config.max_position_embeddings)
        self.eos_ids = eos_ids(self.model)
        self.vocab_size = int(text_config.vocab_size)
        self.stats = EngineStats()
        self.paused = False
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.released: set[str] = set()
        self._released_weights: ReleasedWeights | None = None
        self._admitting: list[Sequence] = []
        self.prefix_cache = prefix_cache(args.prefix_cache_tokens, args.enable_deterministic_inference)
        self.recorder = RoutingRecorder(self.model) if args.enable_return_routed_experts else None
        self.adapters = _adapters(self.model, args) if args.enable_lora else None
        self.vision = load_vision(self.model, args)  # None for a text model
        rng = torch.Generator().manual_seed(args.random_seed)
        template = KVBatch(self.model, rng, self.prefix_cache, self.recorder, self.adapters)
        self._batch = make_batch(template, args.enable_deterministic_inference)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._callbacks: dict[int, Callable[[Sequence], None]] = {}
        self._controls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._warm_up()
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()

    # --- thread-safe entry points -----------------------------------------------------------

    def submit(self, seqs: list[Sequence], on_done: Callable[[Sequence], None]) -> None:
        """Queue `seqs`; `on_done(seq)` runs on the engine thread as each one finishes."""
        with self._cond:
            for s in seqs:
                self._callbacks[id(s)] = on_done
                self._waiting.append(s)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between steps; its result or exception lands in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._controls.append((fn, future))
            self._cond.notify()
        return future

    def abort(self, rid_prefix: str = "", abort_all: bool = False, message: str | None = None) -> int:
        """Mark matching sequences (rid starts with `rid_prefix`) aborted; returns how many. Without a `message`,
        SGLang's: ABORTED for running rows, ABORTED_WAITING for queued ones (scheduler.py::abort_request)."""
        with self._cond:
            hits = 0
            for queue, default in ((self._batch.seqs, ABORTED), (self._waiting, ABORTED_WAITING)):
                for s in queue:
                    if abort_all or s.rid.startswith(rid_prefix):
                        s.abort_message = message or default
                        hits += 1
            self._cond.notify()
        return hits

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # --- engine-thread operations (run them through `call`) -----------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._batch) + len(self._waiting)

    def is_idle(self) -> bool:
        """No row holds KV, and none waits unless paused (scheduler.py::is_fully_idle(ignore_waiting=paused)):
        after a retraction the requests wait without KV, so a flush or a release may go ahead."""
        return not len(self._batch) and (self.paused or not self._waiting)

    def flush_if_idle(self) -> bool:
        """Empty the prefix cache if idle (scheduler.py::flush_cache); whether it did."""
        idle = self.is_idle()
        if idle:
            self.flush_prefix_cache()
        return idle

    def set_paused(self, paused: bool) -> None:
        """Stop (or resume) prefilling and decoding; running rows keep their KV (in_place mode)."""
        self.paused = paused

    def retract_all(self) -> None:
        """Pause, and move every running row to the back of the waiting queue without its KV: after continue it
        is prefilled again, prompt + output, with the weights of that time (scheduler.py::pause_generation,
        retract mode; schedule_batch.py::Req.reset_for_retract)."""
        self.paused = True
        self._finish(self._batch.drop_finished())
        retracted = self._batch.take_all()
        for s in retracted:
            s.retractions += 1
            s.cached_tokens = 0
            s.routing = []
        with self._cond:
            self._waiting.extend(retracted)

    def set_weight_version(self, version: str | None) -> None:
        """Serve under `version` from now; every live sequence with output records where the old version's tokens
        end (scheduler.py::record_weight_version_change). None or the current version changes nothing."""
        if version is None or version == self.weight_version:
            return
        with self._cond:
            live = [*self._batch.seqs, *self._waiting]
        for s in live:
            if s.output:
                s.version_events.append((self.weight_version, len(s.output)))
        self.weight_version = version

    def release(self, tags: list[str] | None) -> None:
        """Free `tags` (None = all); the engine must be idle (`is_idle`)."""
        tags = list(MEMORY_TAGS) if tags is None else tags
        _check_tags(tags)
        if not self.is_idle():
            raise ValueError(f"release_memory_occupation needs an idle engine; {self.num_in_flight} requests in flight")
        if already := sorted(set(tags) & self.released):
            raise ValueError(f"memory {already} already released")
        self.flush_prefix_cache()
        if "weights" in tags:
            self._released_weights = release_weights(self.model, backup=self.args.enable_weights_cpu_backup)
        free_memory(self.device)
        self.released |= set(tags)

    def unload_adapter(self, name: str) -> None:
        """Remove LoRA adapter `name` and the KV it computed. Every /generate call that named it has answered; rows
        of one that hung up may remain, aborted, and leave at the next step before any forward."""
        assert self.adapters is not None
        self.adapters.unload(name)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_adapter(name)

    def flush_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def resume(self, tags: list[str] | None) -> None:
        """Re-allocate `tags` (None = all); each must have been released."""
        tags = list(MEMORY_TAGS) if tags is None else tags
        _check_tags(tags)
        if missing := sorted(set(tags) - self.released):
            raise ValueError(f"resume_memory_occupation of {missing}, which are not released")
        if "weights" in tags:
            assert self._released_weights is not None
            restore_weights(self.model, self._released_weights, self.device)
            self._released_weights = None
        self.released -= set(tags)

    # --- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._controls or self._has_work()):
                    self._cond.wait()
                if self._stopping:
                    break
                controls, self._controls = self._controls, collections.deque()
            for fn, future in controls:
                _run_control(fn, future)
            try:
                self._step()
            except Exception as e:  # a failed forward (e.g. out of memory) ends its requests, not the engine
                self._fail_running(e)
        self.abort(abort_all=True, message="engine shut down")
        self._finish(self._batch.drop_finished() + self._take_waiting(len(self._waiting)))

    def _has_work(self) -> bool:
        if any(s.abort_message is not None for s in [*self._batch.seqs, *self._waiting]):
            return True
        return not self.paused and (len(self._batch) > 0 or len(self._waiting) > 0)

    def _step(self) -> None:
        self._finish(self._batch.drop_finished())
        with self._cond:
            aborted = [s for s in self._waiting if s.abort_message is not None]
            self._waiting = collections.deque(s for s in self._waiting if s.abort_message is None)
        self._finish(aborted)
        if self.paused:
            return
        if self.released & {"weights", "kv_cache"}:
            with self._cond:
                for s in self._waiting:
                    s.abort_message = f"engine memory {sorted(self.released)} is released; resume it first"
            return
        room = self.args.max_running_requests - len(self._batch)
        if room > 0 and self._waiting:
            self._admit(room)
        if len(self._batch):
            rows = len(self._batch)
            self._batch.decode()
            self.stats.decode_steps += 1
            self.stats.generated_tokens += rows
            self.stats.max_batch_size = max(self.stats.max_batch_size, rows)
            self.stats.batch_size_histogram[rows] = self.stats.batch_size_histogram.get(rows, 0) + 1

    def _admit(self, room: int) -> None:
        """Prefill up to `room` waiting sequences together; they join the running batch. Input log-probs come first,
        and prefill-only sequences (max_new_tokens 0) end there (prefill.py::score_admitted)."""
        admitted = self._admitting = self._take_waiting(room)
        self._admitting = score_admitted(self.model, admitted, self.adapters, self.recorder)
        self._finish([s for s in admitted if s.finish is not None])
        if not self._admitting:
            return
        lengths = [len(s.context) for s in self._admitting]
        self._batch.prefill(self._admitting)
        self.stats.prefill_batches += 1
        self.stats.cached_tokens += sum(s.cached_tokens for s in self._admitting)
        self.stats.prefill_tokens += sum(n - s.cached_tokens for n, s in zip(lengths, self._admitting, strict=True))
        self.stats.generated_tokens += len(self._admitting)
        self._admitting = []
        self._finish(self._batch.drop_finished())

    def _fail_running(self, error: Exception) -> None:
        running = [*self._admitting, *self._batch.seqs]
        logger.exception("engine step failed; aborting %d running requests", len(running))
        for s in running:
            s.abort_message = f"engine step failed: {type(error).__name__}: {error}"
            s.routing = []  # the failed step may have recorded part of it
        self._finish(self._admitting)
        self._admitting = []
        self._finish(self._batch.drop_finished())

    def _take_waiting(self, count: int) -> list[Sequence]:
        with self._cond:
            return [self._waiting.popleft() for _ in range(min(count, len(self._waiting)))]

    def _finish(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.finish is None:
                s.finish = FinishReason(type="abort", message=s.abort_message)
            s.version_spans = version_spans(s.version_events, self.weight_version, len(s.output))
            with self._cond:
                callback = self._callbacks.pop(id(s))
            callback(s)

    def _warm_up(self) -> None:
        probe = KVBatch(self.model, torch.Generator(), prefix_cache=None, recorder=self.recorder)
        greedy = RowSampling(temperature=0.0, top_p=1.0, top_k=-1, generator=None)
        seq = Sequence(rid="warmup", prompt=[1, 2], sampling=greedy, max_new_tokens=2, stop_ids=frozenset())
        probe.prefill([seq])
        probe.decode()


def _run_control(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:  # handed to the caller, who answers the HTTP request with it
        future.set_exception(e)


def _check_tags(tags: list[str]) -> None:
    if bad := sorted(set(tags) - set(MEMORY_TAGS)):
        raise ValueError(f"unknown memory tags {bad}; use {list(MEMORY_TAGS)}")


def _adapters(model: transformers.PreTrainedModel, args: EngineArgs) -> "EngineAdapters":
    from megarl.engines.embedded.lora import EngineAdapters, LoraLimits  # peft, only where LoRA is served

    if args.max_lora_rank is None or not args.lora_target_modules:
        raise ValueError("--enable-lora needs --max-lora-rank and --lora-target-modules (all: any projection)")
    return EngineAdapters(
        model, LoraLimits(max_rank=args.max_lora_rank, target_modules=tuple(args.lora_target_modules))
    )


def load_hf_model(
    model_path: str, dtype_name: str, load_format: str, auto_class: Any, device: torch.device
) -> transformers.PreTrainedModel:
    """`auto_class` (a transformers Auto* class) of `model_path` on `device` in eval mode: its weights, or random
    ones under load_format=dummy; `dtype_name` auto = the checkpoint's dtype."""
    if dtype_name not in DTYPES:
        raise ValueError(f"--dtype {dtype_name}: use one of {list(DTYPES)}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format {load_format}: the embedded engine supports auto and dummy")
    config = transformers.AutoConfig.from_pretrained(model_path)
    dtype = DTYPES[dtype_name] or getattr(config, "dtype", None) or torch.float32
    if load_format == "dummy":
        model = auto_class.from_config(config, dtype=dtype)
        keep_fp32(model)
    else:
        model = auto_class.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()
