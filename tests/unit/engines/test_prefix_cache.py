"""The embedded engine's prefix cache on its own: a token budget, longest-prefix hits, least-recently-used eviction."""

import torch

from megarl.engines.embedded.prefix_cache import PrefixCache


def test_prefix_cache_keeps_a_token_budget_and_the_longest_entries() -> None:
    def kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((2, n, 4), fill), torch.full((2, n, 4), -fill))]

    cache = PrefixCache(capacity_tokens=10)
    cache.insert([1, 2, 3], kv(3, 1.0))
    cache.insert([1, 2, 3, 4, 5], kv(5, 2.0), torch.arange(5)[:, None, None])  # extends the first, which goes
    assert (len(cache), cache.num_tokens) == (1, 5)
    hit, layers, routing = cache.lookup([1, 2, 3, 9])
    assert hit == 3 and layers[0][0].shape == (2, 3, 4) and float(layers[0][0][0, 0, 0]) == 2.0
    assert routing is not None and routing.flatten().tolist() == [0, 1, 2]  # the routing of the tokens it kept
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4  # the last prompt token always runs
    cache.insert([7, 8, 9, 10, 11, 12], kv(6, 3.0))  # 11 tokens > 10: the least recently used goes
    assert (len(cache), cache.num_tokens) == (1, 6) and cache.lookup([1, 2, 3, 4])[0] == 0
    cache.insert(list(range(11)), kv(11, 4.0))  # larger than the whole budget: not kept
    assert cache.num_tokens == 6
