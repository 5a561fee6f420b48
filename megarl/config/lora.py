"""LoRA on the actor (`actor.lora`): low-rank adapters on megatron-core's linear layers, the base frozen.

Target names are Hugging Face's (PEFT `target_modules`): a fused megatron layer gets one adapter per HF projection
it fuses (`linear_qkv` ← q/k/v_proj, `linear_fc1` ← gate/up_proj), so an adapter exports to PEFT as it is.
"""

from dataclasses import dataclass, field

LORA_SYNC_MODES = ("adapter", "merged")
LORA_INITS = ("kaiming", "gaussian")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_TARGETS = ("w1", "w3", "w2")
LORA_TARGETS = ATTENTION_TARGETS + MLA_TARGETS + MLP_TARGETS + MIXTRAL_EXPERT_TARGETS
ALL_LINEAR = "all-linear"
"""PEFT's shorthand: every projection of the decoder layers (not the LM head)."""


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """Adapter rank r; 0 = no LoRA (full fine-tuning)."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank)·B·A (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (PEFT's `lora_dropout`); 0 keeps log-probs deterministic."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """HF projection names (`LORA_TARGETS`), or `all-linear`. MoE experts' projections are gate/up/down_proj
    (Mixtral: w1/w3/w2): one adapter per expert, on its expert-parallel rank."""
    init: str = "kaiming"
    """A's initialisation (B starts at zero): kaiming (PEFT's default, kaiming-uniform with a=√5) | gaussian
    (N(0, 1/r))."""
    sync: str = "adapter"
    """How the engines get the policy: adapter (the adapter alone, loaded as a new SGLang LoRA each step; engines
    run with --enable-lora) | merged (W + (alpha/r)·B·A per bucket through the weight sync: any engine)."""
    path: str | None = None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from; None = fresh."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapter_name(weight_version: str | None) -> str:
    """The name engines serve a weight version's adapter under with `sync=adapter` (a new one per version)."""
    return f"megarl-lora-{weight_version or 'initial'}"


def lora_problems(lora: LoraConfig, field_prefix: str = "actor.lora") -> list[str]:
    """Problems of a LoRA config on its own (the model-dependent ones are `megarl.lora.targets`')."""
    if lora.rank == 0:
        return []
    p = field_prefix
    problems = [] if lora.rank >= 1 else [f"{p}.rank={lora.rank} must be >= 1 (or 0 to train every weight)"]
    if lora.alpha <= 0:
        problems.append(f"{p}.alpha={lora.alpha} must be > 0")
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"{p}.dropout={lora.dropout} must be in [0, 1)")
    if lora.init not in LORA_INITS:
        problems.append(f"{p}.init={lora.init!r} is unknown; choose one of {', '.join(LORA_INITS)}")
    if lora.sync not in LORA_SYNC_MODES:
        problems.append(f"{p}.sync={lora.sync!r} is unknown; choose one of {', '.join(LORA_SYNC_MODES)}")
    unknown = [name for name in lora.target_modules if name not in (*LORA_TARGETS, ALL_LINEAR)]
    if unknown or not lora.target_modules:
        problems.append(
            f"{p}.target_modules={list(lora.target_modules)}: unknown {unknown or 'empty list'}; "
            f"choose from {', '.join((ALL_LINEAR, *LORA_TARGETS))}"
        )
    return problems
