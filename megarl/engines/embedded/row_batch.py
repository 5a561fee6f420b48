"""Batch-invariant decoding for `--enable-deterministic-inference` (SGLang's flag of the same name): every sequence
runs in its own one-row `KVBatch`, so each of its forward passes has one row and no padding, and its logits, hence
its tokens and log-probs, do not depend on which other requests the engine happens to run beside it.

On CPU a row's matmul output changes in the last bits with the number of rows (M) it is multiplied with, and its
attention output with the masked padding its keys share with other rows; a prefix-cache hit changes the prefill's
shapes too. Which requests share a step is decided by when their HTTP requests land, so two seeded runs drifted
apart in the low bits and, at a near-tie, sampled different tokens. Here M is 1, nothing is padded and the prefix
cache is off (`make_batch`), at the cost of one forward per running sequence and decode step.
"""

from megarl.engines.embedded.batch import KVBatch, Sequence
from megarl.engines.embedded.prefix_cache import PrefixCache


class RowBatches:
    """The running sequences, one `KVBatch` each, behind `KVBatch`'s interface (prefill, decode, drop, take)."""

    def __init__(self, template: KVBatch) -> None:
        self.template = template
        """Model, sampling RNG, routing recorder and adapters of the rows (no prefix cache); never itself filled."""
        self.rows: list[KVBatch] = []

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seqs[0] for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Prefill each of `seqs` alone, in order, and add its row."""
        t = self.template
        for seq in seqs:
            row = KVBatch(t.model, t.rng, prefix_cache=None, recorder=t.recorder, adapters=t.adapters)
            row.prefill([seq])
            self.rows.append(row)

    def decode(self) -> None:
        """One decode step of every row, each alone."""
        for row in self.rows:
            row.decode()

    def take_all(self) -> list[Sequence]:
        seqs = self.seqs
        self.rows = []
        return seqs

    def drop_finished(self) -> list[Sequence]:
        """Remove and return the rows that finished or were aborted."""
        done = [row.drop_finished() for row in self.rows]
        self.rows = [row for row, dropped in zip(self.rows, done, strict=True) if not dropped]
        return [seq for dropped in done for seq in dropped]


def make_batch(template: KVBatch, deterministic: bool) -> KVBatch | RowBatches:
    """The engine's running batch: `template` itself (continuous batching over one padded cache), or one row per
    sequence when `deterministic`."""
    return RowBatches(template) if deterministic else template


def prefix_cache(tokens: int, deterministic: bool) -> PrefixCache | None:
    """The prefix cache of `tokens` tokens; none when 0 or `deterministic` (a hit changes the prefill's shapes)."""
    return PrefixCache(tokens) if tokens > 0 and not deterministic else None
