"""Padding in a role's training micro-batches: the share of the tokens the model computes that are padding,
with micro-batches padded to their longest row and packed (THD), under an assumed length distribution.

The planner reads no data, so it assumes the lengths: prompt and response lengths each uniform on 1..their
maximum (`data.max_prompt_length`, `data.max_response_length`), `SAMPLE` trajectories drawn from a fixed seed
(the same numbers every run). Real RL responses are usually long-tailed (many short, a few near the maximum),
which makes padding costlier than this assumes.

The trajectories are dealt to per-device mini-batches and split as the trainer splits them
(`megarl.megatron.micro_batches`: a fixed count of rows, or a token budget counting rows × longest padded and
the sum of the rows packed), every row rounded up to `token_multiple`. Expert-parallel peers holding different
rows agree on the number of micro-batches and on each one's length (`megarl.megatron.inputs`): each computes the
longest of the peers' k-th micro-batch.
"""

import random
from dataclasses import dataclass

from megarl.config.root import MegarlConfig
from megarl.config.training import MegatronConfig
from megarl.megatron.micro_batches import split_by_count, split_by_token_budget
from megarl.models.spec import ModelSpec
from megarl.plan.facts import batch_sizes
from megarl.plan.memory import round_up, token_multiple

SAMPLE = 1024
"""Trajectories drawn (at least one mini-batch of every expert-parallel peer)."""
MAX_ROWS = 512
"""Rows per simulated device mini-batch, at most (first-fit packing is quadratic in them)."""
SEED = 0
LENGTHS = "prompt and response lengths each uniform on 1..max"
"""The assumption, as the report states it."""


@dataclass(frozen=True, slots=True)
class Padding:
    """Share of computed tokens that are padding, under the assumed lengths."""

    padded: float
    """Micro-batches padded to their longest row."""
    packed: float
    """Packed: only the rounding of each row to `token_multiple` and the expert-parallel peers' agreement."""
    peers: int
    """Expert-parallel peers that agree on micro-batch lengths (1: none)."""


def assumed_lengths(cfg: MegarlConfig, count: int) -> list[int]:
    """`count` trajectory lengths (prompt + response) drawn as the module docstring says."""
    rng = random.Random(SEED)
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    return [rng.randint(1, p) + rng.randint(1, r) for _ in range(count)]


def expert_peers(spec: ModelSpec, mp: MegatronConfig) -> int:
    """Ranks with different rows in one expert-parallel group (tp_ep: ETP × EP consecutive ranks, of which each
    TP × CP consecutive ones hold the same rows)."""
    if not spec.is_moe or mp.expert_model_parallel_size == 1:
        return 1
    etp = mp.expert_tensor_parallel_size or mp.tensor_model_parallel_size
    return max(1, etp * mp.expert_model_parallel_size // (mp.tensor_model_parallel_size * mp.context_parallel_size))


def padding(cfg: MegarlConfig, spec: ModelSpec, role: str) -> Padding:
    """Padding shares of `role` ("actor" or "critic") padded and packed (module docstring)."""
    mp = (cfg.actor if role == "actor" else cfg.critic).megatron
    s = batch_sizes(cfg, role)
    rows = max(1, min(MAX_ROWS, s.trajectories_per_mini_batch // s.dp))
    peers = expert_peers(spec, mp)
    lengths = assumed_lengths(cfg, rows * peers * max(1, SAMPLE // (rows * peers)))
    real = sum(lengths)
    shares = [1 - real / computed_tokens(cfg, role, lengths, rows, peers, packed) for packed in (False, True)]
    return Padding(padded=shares[0], packed=shares[1], peers=peers)


def computed_tokens(cfg: MegarlConfig, role: str, lengths: list[int], rows: int, peers: int, packed: bool) -> int:
    """Tokens computed for `lengths`: mini-batches of `rows` per device, `peers` devices agreeing."""
    multiple = token_multiple((cfg.actor if role == "actor" else cfg.critic).megatron)
    aligned = [round_up(n, multiple) for n in lengths]
    chunks = [aligned[i : i + rows] for i in range(0, len(aligned), rows)]
    shapes = [_micro_batch_shapes(cfg, role, chunk, packed) for chunk in chunks]
    return sum(_agreed(shapes[i : i + peers]) for i in range(0, len(shapes), peers))


def _micro_batch_shapes(cfg: MegarlConfig, role: str, lengths: list[int], packed: bool) -> list[tuple[int, int]]:
    """(rows, width) of each micro-batch of one device's mini-batch: (1, the sum of its rows) packed."""
    rc = cfg.actor if role == "actor" else cfg.critic
    if rc.use_dynamic_bsz:
        bins = split_by_token_budget(lengths, rc.ppo_max_token_len_per_device, packed=packed)
    else:
        bins = split_by_count(len(lengths), rc.ppo_micro_batch_size_per_device)
    picked = [[lengths[i] for i in b] for b in bins]
    return [(1, sum(b)) if packed else (len(b), max(b)) for b in picked]


def _agreed(shapes: list[list[tuple[int, int]]]) -> int:
    """Tokens the peers compute together: as many micro-batches as the most (a one-row filler where a peer has
    fewer), the k-th of each as wide as the widest k-th."""
    count = max(len(s) for s in shapes)
    total = 0
    for k in range(count):
        kth = [s[k] if k < len(s) else (1, 0) for s in shapes]
        total += sum(rows for rows, _ in kth) * max(width for _, width in kth)
    return total
