"""The running batch: sequences sharing one left-padded KV cache that rows join and leave between steps."""

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from megarl.engines.client.sglang_api import FinishReason, WeightVersionSpan
from megarl.engines.embedded.prefix_cache import LayerKV, PrefixCache
from megarl.engines.embedded.routing import RoutingRecorder
from megarl.engines.embedded.sampler import RowSampling, sample
from megarl.engines.embedded.vision import VisionPrompt, vision_forward_inputs

if TYPE_CHECKING:  # peft is imported only by an engine that serves LoRA (engine.py::_adapters)
    from megarl.engines.embedded.lora import EngineAdapters


@dataclass(kw_only=True, slots=True)
class Sequence:
    """One sample being generated."""

    rid: str
    prompt: list[int]
    sampling: RowSampling
    max_new_tokens: int
    """Already capped by the context length."""
    stop_ids: frozenset[int]
    """EOS and stop_token_ids; empty when ignore_eos."""
    lora_name: str | None = None
    """The LoRA adapter it runs with (the request's `lora_path`); None = the base model."""
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    abort_message: str | None = None
    """Set from another thread; the engine ends the sequence at the next step boundary."""
    cached_tokens: int = 0
    """Context tokens whose KV came from the prefix cache at its last prefill."""
    retractions: int = 0
    """Times a pause in retract mode took it out of the batch."""
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old version, len(output) then) at each weight-version change while it had output."""
    version_spans: list[WeightVersionSpan] = field(default_factory=list)
    """Which version sampled which output tokens; set when it finishes."""
    routed_experts_start_len: int | None = None
    """The request's routed_experts_start_len if it asked for routed experts, else None."""
    token_ids_logprob: list[int] | None = None
    """The request's `token_ids_logprob`: ids whose log-probs are kept at every output position; None = none."""
    top_logprobs_num: int = 0
    """The request's `top_logprobs_num`: how many of the likeliest ids' log-probs are kept at every output position."""
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    """Per output position, the log-probs of `token_ids_logprob` in its order."""
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per output position, the `top_logprobs_num` likeliest (log-prob, id), likeliest first."""
    logprob_start_len: int | None = None
    """The prompt position input log-probs start at: the request's logprob_start_len if it is >= 0 and
    return_logprob is set, else None (none are computed). See prefill.py."""
    input_logprobs: list[float] | None = None
    """log p(prompt[i] | prompt[:i]) for i in (logprob_start_len, len(prompt)); set by the first admission."""
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Like `top_logprobs`, for the same prompt positions as `input_logprobs`."""
    input_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    """Like `token_ids_logprobs`, for the same prompt positions as `input_logprobs`."""
    vision: VisionPrompt | None = None
    """The prompt's images (its `prompt` holds their expanded image tokens); None for a text prompt."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """Routed experts of the context positions forwarded so far, in order, in pieces of int32 [n, layers, top_k]
    (from position 0, cached prefix included): len(context) - 1 rows once prefilled. Empty if the engine records
    none, before the first prefill, and after a retraction (its KV, which the routing belongs to, is freed)."""

    @property
    def context(self) -> list[int]:
        """What a prefill runs: the prompt, and after a retraction the output so far too (its last token pending)."""
        return self.prompt + self.output

    def keep_position_logprobs(self, logprobs: torch.Tensor) -> None:
        """Keep what the request asked of the distribution `logprobs` [v] its next output token is drawn from."""
        if self.token_ids_logprob is not None:
            self.token_ids_logprobs.append(logprobs[self.token_ids_logprob].tolist())
        if self.top_logprobs_num > 0:
            values, ids = logprobs.topk(min(self.top_logprobs_num, len(logprobs)))
            self.top_logprobs.append(list(zip(values.tolist(), ids.tolist(), strict=True)))

    def append(self, token: int, logprob: float) -> None:
        self.output.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish = FinishReason(type="stop", matched=token)
        elif len(self.output) >= self.max_new_tokens:
            self.finish = FinishReason(type="length", length=len(self.output))


class KVBatch:
    """Sequences in rows of one cache [b, heads, L, d] per layer, padding on the left.

    Each row has its last sampled token pending (not yet in the cache); a decode step feeds all of
    them at once. New sequences are prefilled together, each after its cached prefix if the prefix
    cache holds one (those with images one by one, uncached: vision.py), and concatenated in;
    finished rows are dropped (their KV kept in the prefix cache) and all-padding columns trimmed.
    A row's real tokens are where `mask` is 1; padding may sit left of its cached prefix and between
    that prefix and the prefilled rest.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        rng: torch.Generator,
        prefix_cache: PrefixCache | None,
        recorder: RoutingRecorder | None = None,
        adapters: "EngineAdapters | None" = None,
    ) -> None:
        self.model = model
        self.rng = rng  # draws the samples of unseeded sequences
        self.prefix_cache = prefix_cache
        self.recorder = recorder
        """Set: each forward's routed experts are appended to its sequences' `routing`."""
        self.adapters = adapters
        """Set (LoRA enabled): each forward runs every row with its sequence's adapter."""
        self._reset()

    def _reset(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [b, L] 1 = real token
        self.positions = torch.zeros(0, dtype=torch.long)  # [b] position of the pending token
        self.pending = torch.zeros(0, dtype=torch.long)  # [b]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Prefill `seqs` and add their rows: the text ones as one batch, each one with images alone."""
        text = [s for s in seqs if s.vision is None]
        if text:
            self._prefill_text(text)
        for s in seqs:
            if s.vision is not None:
                self._prefill_vision(s, s.vision)

    def _prefill_vision(self, seq: Sequence, vision: VisionPrompt) -> None:
        """Run `seq`'s context with its images, without the prefix cache, and add its row; its next position is
        text position + rope delta, which the decode steps' 1-D positions carry on (vision.py)."""
        inputs, delta = vision_forward_inputs(self.model, seq.context, vision)
        length = len(seq.context)  # sampling appends to it
        mask = torch.ones(1, length, dtype=torch.long)
        cache = DynamicCache(config=self.model.config)
        seq.cached_tokens = 0
        with self._rows([seq]):
            out = self.model(
                **inputs, attention_mask=mask.to(self.device), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        if self.recorder is not None:
            seq.routing = [self.recorder.take(1, length)[0].clone()]
        tokens = self._sample(out.logits[:, -1], [seq])
        self._join([seq], cache, mask, torch.tensor([length + delta]), tokens)

    def _prefill_text(self, seqs: list[Sequence]) -> None:
        """Run the uncached context tokens of `seqs` as one padded batch, sample next tokens, add the rows.

        A retracted sequence's context is prompt + output, so it continues where it stopped, its KV computed
        afresh (schedule_batch.py::Req.reset_for_retract keeps output_ids; the next prefill covers them)."""
        contexts = [s.context for s in seqs]
        hits = [self.prefix_cache.lookup(s.context, s.lora_name) if self.prefix_cache else (0, [], None) for s in seqs]
        past = max(cached for cached, _, _ in hits)
        longest = max(len(c) - cached for c, (cached, _, _) in zip(contexts, hits, strict=True))
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        positions = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), past + longest, dtype=torch.long)
        for i, (s, context, (cached, _, _)) in enumerate(zip(seqs, contexts, hits, strict=True)):
            n = len(context) - cached
            ids[i, longest - n :] = torch.tensor(context[cached:])
            positions[i, longest - n :] = torch.arange(cached, len(context))
            mask[i, past - cached : past] = 1
            mask[i, past + longest - n :] = 1
            s.cached_tokens = cached
        cache = DynamicCache(config=self.model.config)
        if past:
            for layer, kv in enumerate(_stack_right_aligned([kv for _, kv, _ in hits], past)):
                cache.update(*kv, layer)
        with self._rows(seqs):
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if self.recorder is not None:
            picked = self.recorder.take(len(seqs), longest)  # [b, longest, layers, top_k]
            for s, row, (cached, _, prefix) in zip(seqs, picked, hits, strict=True):
                assert cached == 0 or prefix is not None, "a cached prefix carries the routing that computed it"
                computed = row[longest - (len(s.context) - cached) :].clone()
                s.routing = [computed] if prefix is None else [prefix, computed]
        tokens = self._sample(out.logits[:, -1], seqs)
        self._join(seqs, cache, mask, positions[:, -1] + 1, tokens)

    @torch.no_grad()
    def decode(self) -> None:
        """Feed every row's pending token and sample the next one."""
        assert self.cache is not None
        self.mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        with self._rows(self.seqs):
            out = self.model(
                input_ids=self.pending[:, None].to(self.device),
                attention_mask=self.mask.to(self.device),
                position_ids=self.positions[:, None].to(self.device),
                past_key_values=self.cache,
                use_cache=True,
            )
        if self.recorder is not None:
            for s, row in zip(self.seqs, self.recorder.take(len(self), 1), strict=True):
                s.routing.append(row)
        self.positions = self.positions + 1
        self.pending = self._sample(out.logits[:, -1], self.seqs)

    def _rows(self, seqs: list[Sequence]) -> contextlib.AbstractContextManager[None]:
        """Where LoRA is enabled, the forward runs row i with `seqs[i]`'s adapter."""
        return self.adapters.rows([s.lora_name for s in seqs]) if self.adapters else contextlib.nullcontext()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens, logprobs = sample(logits.float().cpu(), [s.sampling for s in seqs], self.rng)  # [b], [b, v]
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
        for s, row, t, lp in zip(seqs, logprobs, tokens.tolist(), chosen.tolist(), strict=True):
            s.keep_position_logprobs(row)
            s.append(t, lp)
        return tokens

    def _join(
        self,
        seqs: list[Sequence],
        cache: DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        pending: torch.Tensor,
    ) -> None:
        if self.cache is None:
            self.seqs, self.cache, self.mask, self.positions, self.pending = list(seqs), cache, mask, positions, pending
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            (k1, v1), (k2, v2) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_left_pad(k1, length), _left_pad(k2, length)])
            mine.values = torch.cat([_left_pad(v1, length), _left_pad(v2, length)])
        self.mask = torch.cat([F.pad(m, (length - m.shape[1], 0)) for m in (self.mask, mask)])
        self.seqs += seqs
        self.positions = torch.cat([self.positions, positions])
        self.pending = torch.cat([self.pending, pending])

    def _row_kv(self, row: int) -> list[LayerKV]:
        """Row `row`'s own tokens' KV per layer, [heads, tokens, d] each (a copy)."""
        assert self.cache is not None
        cols = self.mask[row].nonzero()[:, 0].to(self.device)
        return [(k[row][:, cols], v[row][:, cols]) for k, v in map(_kv, _layers(self.cache))]

    def take_all(self) -> list[Sequence]:
        """Remove every row and free its KV, keeping none in the prefix cache (a retraction)."""
        seqs = self.seqs
        self._reset()
        return seqs

    def drop_finished(self) -> list[Sequence]:
        """Remove and return the rows that finished or were aborted; trim padding no row needs."""
        done = [s for s in self.seqs if s.finish is not None or s.abort_message is not None]
        if not done:
            return []
        if self.prefix_cache is not None:
            for i, s in enumerate(self.seqs):
                if s.finish is not None and s.abort_message is None and s.vision is None:
                    kv = self._row_kv(i)
                    assert kv[0][0].shape[1] == len(s.prompt) + len(s.output) - 1, "cache and tokens disagree"
                    routing = torch.cat(s.routing) if s.routing else None
                    self.prefix_cache.insert(s.prompt + s.output[:-1], kv, routing, s.lora_name)
        keep = [i for i, s in enumerate(self.seqs) if s.finish is None and s.abort_message is None]
        if not keep:
            self._reset()
            return done
        rows = torch.tensor(keep)
        self.mask, self.positions, self.pending = self.mask[rows], self.positions[rows], self.pending[rows]
        start = int(self.mask.any(dim=0).nonzero()[0])
        self.mask = self.mask[:, start:]
        assert self.cache is not None
        device_rows = rows.to(self.device)
        for layer in _layers(self.cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[device_rows, :, start:], values[device_rows, :, start:]
        self.seqs = [self.seqs[i] for i in keep]
        return done


def _stack_right_aligned(hits: list[list[LayerKV]], length: int) -> list[LayerKV]:
    """Per layer, the rows' cached KV [b, heads, length, d], each right-aligned (zeros where a row has none). Keys
    and values may differ in width (DeepSeek's MLA cache in transformers: qk head dim vs v head dim)."""
    k0, v0 = next(kv for kv in hits if kv)[0]
    stacked = []
    for layer in range(len(next(kv for kv in hits if kv))):
        keys = torch.zeros(len(hits), k0.shape[0], length, k0.shape[2], dtype=k0.dtype, device=k0.device)
        values = torch.zeros(len(hits), v0.shape[0], length, v0.shape[2], dtype=v0.dtype, device=v0.device)
        for i, kv in enumerate(hits):
            if kv:
                k, v = kv[layer]
                keys[i, :, length - k.shape[1] :] = k
                values[i, :, length - v.shape[1] :] = v
        stacked.append((keys, values))
    return stacked


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, 0, length - t.shape[2], 0))


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers; the engine batches full-attention layers only."""
    layers = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) is not DynamicLayer:
            raise ValueError(f"the embedded engine needs full-attention layers; got {type(layer).__name__}")
        layers.append(layer)
    return layers


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The end-of-sequence ids of `model`'s (text) config and generation config."""
    ids: set[int] = set()
    for source in (model.config.get_text_config(), model.generation_config):
        eos = getattr(source, "eos_token_id", None)
        ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return frozenset(ids)
