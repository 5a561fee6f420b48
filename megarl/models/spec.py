"""What megarl needs to know about a Hugging Face model, read once from its config.

`ModelSpec` is the only place that reads HF config attributes; the Megatron bridge, the weight
plan and the planner work from it. Supported: Qwen2/Qwen2.5, Llama (incl. Llama-3 RoPE scaling),
Qwen3 dense, Qwen3-MoE, Mixtral, Qwen1.5/Qwen2-MoE (a shared expert behind a sigmoid gate),
GLM-4.5 (`glm4_moe`: sigmoid + bias routing, shared experts, partial rotary, dense first layers)
DeepSeek-V3 / Moonlight (multi-latent attention, YaRN, group-limited top-k), and the vision-language
Qwen2.5-VL (its Qwen2 language model plus a vision tower: `megarl.models.vision`).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored after the last decoder layer)
are loaded and ignored: the weight plan names only the decoder's layers, so those tensors are
never read, and a converted or synced checkpoint carries none.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.models.vision import VISION_FAMILIES, VisionSpec, text_config, vision_spec

DENSE_TYPES = ("qwen2", "llama", "qwen3")
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3")
SUPPORTED_MODEL_TYPES = DENSE_TYPES + MOE_TYPES
SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3")
"""Families that score experts with a sigmoid plus a learned correction bias (`e_score_correction_bias`)."""


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN RoPE scaling (DeepSeek-V3): HF `rope_parameters` with rope_type `yarn`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True, slots=True)
class Mla:
    """Multi-latent attention (DeepSeek-V2/V3): low-rank Q and KV with a decoupled RoPE part."""

    q_lora_rank: int | None
    """None: Q is one full projection (`q_proj`), as in DeepSeek-V2-Lite and Moonlight."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Query/key head width; under MLA the full qk width (nope + rope)."""
    ffn_hidden_size: int
    """The dense MLP's width (dense models and the dense layers of a MoE model)."""
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    """Llama-3 RoPE scaling factor; None without it."""
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rotary_percent: float = 1.0
    """Share of each head that RoPE rotates (GLM-4.5: 0.5)."""
    rope_interleave: bool = False
    """RoPE on interleaved (even, odd) pairs instead of halves (DeepSeek-V3's `rope_interleave`)."""
    yarn: Yarn | None = None
    mla: Mla | None = None
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    moe_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_layers: tuple[bool, ...] = ()
    """Per decoder layer, whether its MLP is routed experts (empty for a dense model)."""
    moe_score_function: str = "softmax"
    """`softmax` or `sigmoid` (with `moe_expert_bias`; top-k weights renormalised)."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the scores for selection only (`e_score_correction_bias`)."""
    moe_num_groups: int = 0
    """Group-limited top-k: experts split into this many groups (0: no groups)."""
    moe_group_topk: int = 0
    """Groups each token may pick its experts from (0: no groups)."""
    moe_scaling_factor: float | None = None
    """`routed_scaling_factor` on the routed output; None = 1."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert(s), summed; 0 without."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled by sigmoid(`shared_expert_gate`·x)."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers in the checkpoint; loaded and ignored (see the module docstring)."""
    vision: VisionSpec | None = None
    """A vision-language model's tower and M-RoPE (`megarl.models.vision`); `model_type` is then its text family's."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_prefix(self) -> str:
        """HF module holding the router and experts."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    @property
    def shared_expert_prefix(self) -> str:
        """HF module of the shared expert(s), under `moe_prefix`."""
        return "shared_expert" if self.model_type == "qwen2_moe" else "shared_experts"

    @property
    def expert_weight_names(self) -> tuple[str, str, str]:
        """HF per-expert (gate, up, down) tensor names on disk."""
        if self.model_type == "mixtral":
            return ("w1.weight", "w3.weight", "w2.weight")
        return ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def load_hf_config(path: str | Path) -> Any:
    """The transformers config of a model directory, with a clear error for a bad path."""
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: model.path must be a Hugging Face model directory")
    return AutoConfig.from_pretrained(str(path))


def _check_supported(hf_config: Any) -> None:
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the Megatron bridge; supported: {SUPPORTED_MODEL_TYPES} "
            f"and the vision-language {tuple(VISION_FAMILIES)}"
        )
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; the bridge maps silu (SwiGLU) only")
    if model_type in ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3") and getattr(
        hf_config, "attention_bias", False
    ):
        raise ValueError(f"{model_type} with attention_bias=True (biased o_proj) is not supported by the bridge")
    groups, group_topk = getattr(hf_config, "n_group", 1) or 1, getattr(hf_config, "topk_group", 1) or 1
    if groups > 1 and hf_config.num_experts_per_tok // group_topk != 2:
        raise ValueError(
            f"{model_type}: n_group={groups} with num_experts_per_tok // topk_group != 2 is not supported: "
            "transformers scores a group by its top-2 experts, megatron-core by its top (top-k // topk_group)"
        )
    if model_type in SIGMOID_ROUTED and not hf_config.norm_topk_prob and hf_config.num_experts_per_tok > 1:
        raise ValueError(
            f"{model_type} with norm_topk_prob=False is not supported: megatron-core renormalises sigmoid top-k weights"
        )


def _rope(hf_config: Any) -> dict[str, Any]:
    rope = dict(hf_config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; the bridge maps 'default', 'llama3' and 'yarn'")
    if rope_type == "yarn" and hf_config.model_type != "deepseek_v3":
        raise ValueError(f"rope_type 'yarn' is supported for deepseek_v3 only, not {hf_config.model_type!r}")
    yarn = None
    if rope_type == "yarn":
        yarn = Yarn(
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )
    return {
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling_factor": float(rope["factor"]) if rope_type == "llama3" else None,
        "rotary_percent": float(rope.get("partial_rotary_factor", 1.0)),
        "rope_interleave": bool(getattr(hf_config, "rope_interleave", False)),
        "yarn": yarn,
    }


def _mla(hf_config: Any) -> Mla | None:
    if hf_config.model_type != "deepseek_v3":
        return None
    return Mla(
        q_lora_rank=hf_config.q_lora_rank or None,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
    )


def _moe_layers(hf_config: Any) -> tuple[bool, ...]:
    """Which layers route: all but the first `first_k_dense_replace` (GLM-4.5, DeepSeek-V3), or every
    `decoder_sparse_step`-th layer not in `mlp_only_layers` (Qwen2/Qwen3-MoE, as their HF decoder layer decides)."""
    n = hf_config.num_hidden_layers
    if hasattr(hf_config, "first_k_dense_replace"):
        return tuple(i >= hf_config.first_k_dense_replace for i in range(n))
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def _moe(hf_config: Any) -> dict[str, Any]:
    model_type = hf_config.model_type
    if model_type not in MOE_TYPES:
        return {}
    sigmoid = model_type in SIGMOID_ROUTED
    if model_type == "mixtral":
        num_experts, renormalise = hf_config.num_local_experts, True
    else:
        num_experts = getattr(hf_config, "n_routed_experts", None) or hf_config.num_experts
        renormalise = bool(hf_config.norm_topk_prob)
    shared_width = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    if sigmoid:
        shared_width = hf_config.n_shared_experts * hf_config.moe_intermediate_size
    groups = getattr(hf_config, "n_group", 1) or 1
    scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
    return {
        "num_experts": num_experts,
        "moe_ffn_hidden_size": getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        "moe_topk": hf_config.num_experts_per_tok,
        "moe_pre_softmax": not sigmoid and not renormalise,
        "moe_aux_loss_coeff": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        "moe_layers": _moe_layers(hf_config),
        "moe_score_function": "sigmoid" if sigmoid else "softmax",
        "moe_expert_bias": sigmoid,
        "moe_num_groups": groups if groups > 1 else 0,
        "moe_group_topk": hf_config.topk_group if groups > 1 else 0,
        "moe_scaling_factor": scaling if scaling != 1.0 else None,
        "shared_expert_ffn_hidden_size": shared_width,
        "shared_expert_gate": model_type == "qwen2_moe",
    }


def _attention(hf_config: Any, mla: Mla | None) -> dict[str, Any]:
    model_type = hf_config.model_type
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if mla is not None:
        head_dim = mla.qk_head_dim
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True)))
    if model_type == "glm4_moe":
        qkv_bias = bool(hf_config.attention_bias)
    qk_norm = model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and bool(hf_config.use_qk_norm))
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_heads if mla is not None else hf_config.num_key_value_heads,
        "head_dim": head_dim,
        "qkv_bias": qkv_bias,
        "qk_norm": qk_norm,
    }


def model_spec(config: Any) -> ModelSpec:
    """Read a transformers config into a `ModelSpec`, refusing what the bridge cannot map. A vision-language
    config is read as its language model plus `vision` (`megarl.models.vision`)."""
    hf_config = text_config(config)
    _check_supported(hf_config)
    mla = _mla(hf_config)
    return ModelSpec(
        model_type=hf_config.model_type,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        mla=mla,
        num_mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),
        vision=vision_spec(config),
        **_attention(hf_config, mla),
        **_rope(hf_config),
        **_moe(hf_config),
    )
