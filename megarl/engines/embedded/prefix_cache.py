"""KV of finished sequences, reused by later requests that start with the same tokens.

A multi-turn trajectory resends its whole conversation each turn; with the router's sticky
routing the next turn lands here and only its new tokens are prefilled. Entries are kept in LRU
order within a budget of tokens; a lookup takes the longest common prefix with any entry (at most
the prompt minus its last token, which must run to produce logits). When the engine records routed
experts, an entry keeps those of its tokens too, so a hit returns the routing of the forward that
computed the prefix (SGLang files routings by KV slot: `srt/state_capturer/base.py::get_topk`). KV computed
under a LoRA adapter serves only requests with that adapter (SGLang keys its radix cache by the LoRA too).
"""

import collections
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""Keys and values of one layer, [heads, tokens, head_dim] each."""


@dataclass(kw_only=True, slots=True)
class _Entry:
    tokens: torch.Tensor  # [L] int64 on the CPU
    kv: list[LayerKV]
    routing: torch.Tensor | None  # [L, layers, top_k] int32, or None when not recorded
    adapter: str | None  # the LoRA adapter that computed the KV; None = the base model


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_key = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], adapter: str | None = None) -> tuple[int, list[LayerKV], torch.Tensor | None]:
        """The longest prefix of `prompt` (shorter than it) cached under `adapter`: its length, per-layer KV slices
        and routing."""
        best, best_key = 0, None
        ids = torch.tensor(prompt)
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(prompt) - 1)
            if n <= best or entry.adapter != adapter:
                continue
            same = entry.tokens[:n] == ids[:n]
            common = n if bool(same.all()) else int((~same).nonzero()[0])
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return 0, [], None
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        routing = None if entry.routing is None else entry.routing[:best]
        return best, [(k[:, :best], v[:, :best]) for k, v in entry.kv], routing

    def insert(
        self, tokens: list[int], kv: list[LayerKV], routing: torch.Tensor | None = None, adapter: str | None = None
    ) -> None:
        """Keep the KV `adapter` computed for `tokens`; its entries that are a prefix of them are dropped, the oldest
        evicted."""
        if not tokens or len(tokens) > self.capacity_tokens:
            return
        ids = torch.tensor(tokens)
        for key in [k for k, e in self._entries.items() if len(e.tokens) <= len(ids) and e.adapter == adapter]:
            entry = self._entries[key]
            if torch.equal(entry.tokens, ids[: len(entry.tokens)]):
                self._drop(key)
        self._entries[self._next_key] = _Entry(tokens=ids, kv=kv, routing=routing, adapter=adapter)
        self._next_key += 1
        self.num_tokens += len(tokens)
        while self.num_tokens > self.capacity_tokens:
            self._drop(next(iter(self._entries)))

    def drop_adapter(self, adapter: str) -> None:
        """Forget the KV `adapter` computed (it is being unloaded)."""
        for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
            self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self.num_tokens = 0

    def _drop(self, key: int) -> None:
        self.num_tokens -= len(self._entries.pop(key).tokens)
