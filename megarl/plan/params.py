"""Parameter counts of a decoder-only model, and the share one device holds under a Megatron layout.

Counts come from the `ModelSpec` alone (no weights): attention (Q/K/V/O, biases for Qwen2,
QK-norms for Qwen3), the dense MLP or the router + experts (SwiGLU: gate, up, down), the norms,
the embedding and the output layer (absent when tied). They equal `sum(p.numel())` of the
transformers model (tests/test_plan.py checks the tiny models and the published totals).
"""

from dataclasses import dataclass

from megarl.config.training import MegatronConfig
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import padded_vocab_size


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameters of the model by where they live in a Megatron layout."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    tied: bool
    """The output layer reuses the embedding."""
    layer_replicated: int
    """Per layer, held whole by every TP rank: norms and the MoE router."""
    layer_sharded: int
    """Per layer, split by TP: attention projections (+ biases) and the dense MLP."""
    expert: int
    """One expert (gate, up, down); 0 for a dense model."""
    num_experts: int
    topk: int

    @property
    def embedding(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output(self) -> int:
        return 0 if self.tied else self.vocab_size * self.hidden_size

    @property
    def total(self) -> int:
        """All parameters (the final norm included)."""
        per_layer = self.layer_replicated + self.layer_sharded + self.num_experts * self.expert
        return self.embedding + self.output + self.hidden_size + self.num_layers * per_layer

    @property
    def active(self) -> int:
        """Parameters one token passes through: `topk` experts per layer instead of all of them."""
        return self.total - self.num_layers * (self.num_experts - self.topk) * self.expert


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts of the architecture described by `spec`."""
    h = spec.hidden_size
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = h * (q_dim + 2 * kv_dim) + (q_dim + 2 * kv_dim if spec.qkv_bias else 0)
    norms = 2 * h + (2 * spec.head_dim if spec.qk_norm else 0)
    return ParamCounts(
        vocab_size=spec.vocab_size,
        hidden_size=h,
        num_layers=spec.num_layers,
        tied=spec.tie_word_embeddings,
        layer_replicated=norms + h * spec.num_experts,
        layer_sharded=qkv + q_dim * h + (0 if spec.is_moe else 3 * h * spec.ffn_hidden_size),
        expert=3 * h * spec.moe_ffn_hidden_size if spec.is_moe else 0,
        num_experts=spec.num_experts,
        topk=spec.moe_topk,
    )


@dataclass(frozen=True, slots=True)
class DeviceShard:
    """Parameters on the fullest device of a role: dense ones (optimizer state sharded over DP) and
    expert ones (sharded over the expert-data-parallel group)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def device_shard(counts: ParamCounts, mp: MegatronConfig, value_head: bool = False) -> DeviceShard:
    """The share of the fullest pipeline stage's device (first: embedding, last: output layer).

    Megatron pads the vocabulary to a multiple of 128×TP, and with PP>1 a tied model keeps a copy
    of the embedding on the last stage. A critic (`value_head`) has a 1-wide head instead.
    """
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    etp, ep = mp.expert_tensor_parallel_size or tp, mp.expert_model_parallel_size
    layers = counts.num_layers // pp
    vocab_shard = padded_vocab_size(counts.vocab_size, tp) * counts.hidden_size // tp
    lm_head = vocab_shard if (not counts.tied or pp > 1) else 0
    head = counts.hidden_size if value_head else lm_head
    first, last = vocab_shard, head + counts.hidden_size
    edge = first + last if pp == 1 else max(first, last)
    body = layers * (counts.layer_replicated + counts.layer_sharded // tp)
    return DeviceShard(dense=body + edge, expert=layers * counts.num_experts * counts.expert // (ep * etp))
