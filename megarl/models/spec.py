"""What megarl needs to know about a Hugging Face model, read once from its config.

`ModelSpec` is the only place that reads HF config attributes; the Megatron bridge and the
weight plan work from it. Supported: Qwen2/Qwen2.5, Llama (incl. Llama-3 RoPE scaling), Qwen3
dense, Qwen3-MoE and Mixtral.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DENSE_TYPES = ("qwen2", "llama", "qwen3")
MOE_TYPES = ("qwen3_moe", "mixtral")
SUPPORTED_MODEL_TYPES = DENSE_TYPES + MOE_TYPES


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    moe_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_prefix(self) -> str:
        """HF module holding the router and experts."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

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


def model_spec(hf_config: Any) -> ModelSpec:
    """Read a transformers config into a `ModelSpec`, refusing what the bridge cannot map."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the Megatron bridge; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; the bridge maps silu (SwiGLU) only")
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{model_type} with attention_bias=True (biased o_proj) is not supported by the bridge")
    rope = dict(hf_config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; the bridge maps 'default' and 'llama3'")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    moe: dict[str, Any] = {}
    if model_type in MOE_TYPES:
        num_experts = hf_config.num_experts if model_type == "qwen3_moe" else hf_config.num_local_experts
        renormalise = True if model_type == "mixtral" else bool(hf_config.norm_topk_prob)
        if model_type == "qwen3_moe" and (hf_config.mlp_only_layers or hf_config.decoder_sparse_step != 1):
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
        moe = {
            "num_experts": num_experts,
            "moe_ffn_hidden_size": getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
            "moe_topk": hf_config.num_experts_per_tok,
            "moe_pre_softmax": not renormalise,
            "moe_aux_loss_coeff": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        }
    return ModelSpec(
        model_type=model_type,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling_factor=float(rope["factor"]) if rope_type == "llama3" else None,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )
