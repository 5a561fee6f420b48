"""The running batch: sequences sharing one left-padded KV cache that rows join and leave between steps."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from megarl.rollout.embedded.sampler import RowSampling, sample
from megarl.rollout.protocol import FinishReason


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
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    abort_message: str | None = None
    """Set from another thread; the engine ends the sequence at the next step boundary."""

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
    them at once. New sequences are prefilled together and concatenated in; finished rows are
    dropped and all-padding columns trimmed.
    """

    def __init__(self, model: PreTrainedModel, rng: torch.Generator) -> None:
        self.model = model
        self.rng = rng  # draws the samples of unseeded sequences
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
        """Run the prompts of `seqs` as one padded batch, sample their first tokens, and add them as rows."""
        longest = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, longest - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, longest - len(s.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens = self._sample(out.logits[:, -1], seqs)
        self._join(seqs, cache, mask, positions[:, -1] + 1, tokens)

    @torch.no_grad()
    def decode(self) -> None:
        """Feed every row's pending token and sample the next one."""
        assert self.cache is not None
        self.mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=self.pending[:, None].to(self.device),
            attention_mask=self.mask.to(self.device),
            position_ids=self.positions[:, None].to(self.device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.positions = self.positions + 1
        self.pending = self._sample(out.logits[:, -1], self.seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens, logprobs = sample(logits.float().cpu(), [s.sampling for s in seqs], self.rng)
        for s, t, lp in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
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

    def drop_finished(self) -> list[Sequence]:
        """Remove and return the rows that finished or were aborted; trim padding no row needs."""
        done = [s for s in self.seqs if s.finish is not None or s.abort_message is not None]
        if not done:
            return []
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
