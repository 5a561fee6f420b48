"""Parameter counts of a decoder-only model, and the share one device holds under a Megatron layout.

Counts come from the `ModelSpec` alone (no weights), layer by layer: attention (Q/K/V/O with the
biases of Qwen2 and GLM-4.5 and the QK-norms of Qwen3, or multi-latent attention's down and up
projections with their norms), the dense MLP or the router, the routed experts and the shared
expert(s) (SwiGLU: gate, up, down; Qwen2-MoE's shared-expert gate), the norms, the embedding and
the output layer (absent when tied). They equal `sum(p.numel() for p in model.parameters())` of the
transformers model (tests/unit/plan/test_plan.py checks every shipped config): the expert-score correction
bias of sigmoid routers is a buffer in transformers and megatron-core alike, so it is not counted,
nor are multi-token-prediction layers, which transformers does not build and megarl ignores. A vision-language
model adds its vision tower, counted from its parameters' shapes (`megarl.models.vision.VisionSpec.params`).
"""

import math
from dataclasses import dataclass

from megarl.config.layout import stage_layers
from megarl.config.training import MegatronConfig
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import padded_vocab_size


@dataclass(frozen=True, slots=True)
class LayerCounts:
    """One decoder layer's parameters by where they live in a Megatron layout."""

    replicated: int
    """Held whole by every TP rank: norms, the MoE router, Qwen2-MoE's shared-expert gate, and MLA's down
    projections (duplicated, as `megarl.models.mla` builds them with either layer implementation)."""
    sharded: int
    """Split by TP: attention projections (+ biases), the dense MLP or the shared expert(s)."""
    experts: int = 0
    """All routed experts, split over EP × ETP; 0 for a dense layer."""
    active_experts: int = 0
    """The routed experts one token passes through (top-k of them)."""

    @property
    def total(self) -> int:
        return self.replicated + self.sharded + self.experts


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameters of the model by where they live in a Megatron layout."""

    vocab_size: int
    hidden_size: int
    tied: bool
    """The output layer reuses the embedding."""
    layers: tuple[LayerCounts, ...]
    vision: int = 0
    """A vision-language model's vision tower (incl. its patch merger), held whole on the first stage."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embedding(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output(self) -> int:
        return 0 if self.tied else self.vocab_size * self.hidden_size

    @property
    def routed_experts(self) -> int:
        """Parameters of all routed experts (those split over EP × ETP)."""
        return sum(layer.experts for layer in self.layers)

    @property
    def total(self) -> int:
        """All parameters (the final norm included)."""
        layers = sum(layer.total for layer in self.layers)
        return self.vision + self.embedding + self.output + self.hidden_size + layers

    @property
    def active(self) -> int:
        """Parameters one token passes through: top-k routed experts per MoE layer instead of all of them."""
        return self.total - sum(layer.experts - layer.active_experts for layer in self.layers)


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts of the architecture described by `spec`."""
    moe_layers = spec.moe_layers or (False,) * spec.num_layers
    return ParamCounts(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        tied=spec.tie_word_embeddings,
        layers=tuple(_layer(spec, moe) for moe in moe_layers),
        vision=sum(math.prod(shape) for _, shape in spec.vision.params) if spec.vision else 0,
    )


def _layer(spec: ModelSpec, moe: bool) -> LayerCounts:
    h = spec.hidden_size
    replicated, sharded = _mla(spec) if spec.mla is not None else _gqa(spec)
    replicated += 2 * h  # input and pre-MLP norms
    if not moe:
        return LayerCounts(replicated=replicated, sharded=sharded + 3 * h * spec.ffn_hidden_size)
    expert = 3 * h * spec.moe_ffn_hidden_size
    return LayerCounts(
        replicated=replicated + h * spec.num_experts + (h if spec.shared_expert_gate else 0),
        sharded=sharded + 3 * h * spec.shared_expert_ffn_hidden_size,
        experts=spec.num_experts * expert,
        active_experts=spec.moe_topk * expert,
    )


def _gqa(spec: ModelSpec) -> tuple[int, int]:
    """(replicated, sharded) of grouped-query attention: QK-norms; Q/K/V (+ biases) and O."""
    h = spec.hidden_size
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = (h + (1 if spec.qkv_bias else 0)) * (q_dim + 2 * kv_dim)
    return (2 * spec.head_dim if spec.qk_norm else 0), qkv + q_dim * h


def _mla(spec: ModelSpec) -> tuple[int, int]:
    """(replicated, sharded) of multi-latent attention (HF names): the down projections q_a_proj and
    kv_a_proj_with_mqa with their norms; q_proj or q_b_proj, kv_b_proj and o_proj."""
    mla, h, heads = spec.mla, spec.hidden_size, spec.num_heads
    assert mla is not None
    kv_down = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = heads * mla.v_head_dim * h
    q_heads = heads * mla.qk_head_dim
    if mla.q_lora_rank is None:
        return kv_down + mla.kv_lora_rank, h * q_heads + kv_up + out
    q_down = (h + 1) * mla.q_lora_rank  # q_a_proj and q_a_layernorm
    return q_down + kv_down + mla.kv_lora_rank, mla.q_lora_rank * q_heads + kv_up + out


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
    """The share of the fullest pipeline stage's device (first: embedding, last: output layer; with
    dense first layers, as in DeepSeek-V3, the first stage's layers differ from the others').

    Megatron pads the vocabulary to a multiple of 128×TP, and with PP>1 a tied model keeps a copy
    of the embedding on the last stage. A critic (`value_head`) has a 1-wide head instead.
    """
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    etp, ep = mp.expert_tensor_parallel_size or tp, mp.expert_model_parallel_size
    vocab_shard = padded_vocab_size(counts.vocab_size, tp) * counts.hidden_size // tp
    lm_head = vocab_shard if (not counts.tied or pp > 1) else 0
    last = (counts.hidden_size if value_head else lm_head) + counts.hidden_size  # head + final norm
    stages = []
    for stage, held in enumerate(stage_layers(mp, counts.num_layers)):
        layers = [counts.layers[i] for i in held]
        dense = sum(x.replicated + x.sharded // tp for x in layers)
        edges = (vocab_shard + counts.vision if stage == 0 else 0) + (last if stage == pp - 1 else 0)
        stages.append(DeviceShard(dense=dense + edges, expert=sum(x.experts for x in layers) // (ep * etp)))
    return max(stages, key=lambda shard: shard.total)
