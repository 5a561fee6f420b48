"""Megatron-side roles: actor, critic and reference — their parallel layout, optimizer and batch sizes."""

from dataclasses import dataclass, field

from megarl.config.lora import LoraConfig

OPTIMIZER_NAMES = ("adam", "sgd")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """TP: splits attention heads and MLP columns across devices; must divide heads and KV heads."""
    pipeline_model_parallel_size: int = 1
    """PP: splits layers into stages; must divide num_hidden_layers (× virtual stages) unless the first or last
    stage's layer count is set."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved 1F1B: model chunks per pipeline stage; None = plain 1F1B."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Uneven stages (PP>1): layers of the first stage; the stages not set split the rest evenly (megatron's
    field of the same name; e.g. DeepSeek-V3's 61 layers at PP8: first 5, last 8, six stages of 8). None = even."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Uneven stages (PP>1): layers of the last stage (it also holds the output layer and loss). None = even."""
    context_parallel_size: int = 1
    """CP: splits each sequence across devices."""
    expert_model_parallel_size: int = 1
    """EP: splits MoE experts across devices; must divide num_experts."""
    expert_tensor_parallel_size: int | None = None
    """TP inside each expert; None = tensor_model_parallel_size (megatron's default)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in TP regions; required for MoE with TP>1."""
    sequence_packing: bool = True
    """Micro-batches as packed sequences (THD: the rows' real tokens one after the other, attention within each,
    `megarl.megatron.packing`) instead of rows padded to the longest; needed for context_parallel_size > 1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    transformer_impl: str = "auto"
    """Layer implementation: local (megatron's torch layers) | transformer_engine (TE layers: fused
    kernels, attention that does not materialise [s, s]; GPUs only) | auto (TE on GPUs where it imports)."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: str = "adam"
    """adam (AdamW) | sgd. The distributed optimizer supports adam only."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up length in optimizer steps."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine, over the run's total optimizer steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the policy."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Policy optimizer."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (× rollout.n trajectories); must divide data.train_batch_size."""
    ppo_micro_batch_size_per_device: int = 4
    """Trajectories per forward/backward on one device (ignored when use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of a fixed count (no divisibility by DP needed)."""
    ppo_max_token_len_per_device: int = 16384
    """Token budget of one micro-batch per device when use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over each step's trajectories."""
    shuffle: bool = True
    """Shuffle trajectories between mini-batches."""
    log_prob_micro_batch_size_per_device: int | None = None
    """Trajectories per forward when recomputing log-probs; None = ppo_micro_batch_size_per_device."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (`actor.lora.rank` > 0): base weights frozen, the reference is
    the actor with its adapters off, the engines get the adapter (or the merged weights) each step."""
    router_replay: str = "disabled"
    """MoE routing replay (`ROUTER_REPLAY_MODES`): `R3` routes every token through the experts the rollout engine
    chose, in the old-log-prob pass and the update; `R2` records the old-log-prob pass's routing and replays it in
    the update; `disabled`: the routers choose live."""


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


def reference_replays_routing(actor: ActorConfig) -> bool:
    """The reference replays the rollout engines' routing under R3, so the KL compares the two policies on the
    experts the sample was drawn with. Under R2 it routes live: the record is the actor's own choice at its current
    weights, not something the rollout used (slime `actor.py::train_actor` runs its reference "fallthrough")."""
    return actor.router_replay == "R3"


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    enable: bool | None = None
    """Train a value model; None = only when the advantage estimator needs values (gae)."""
    model_path: str | None = None
    """Initial critic weights (HF directory); None = model.path with a fresh value head."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the critic."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = 16
    """Prompts per critic optimizer step; must divide data.train_batch_size."""
    ppo_micro_batch_size_per_device: int = 4
    """Trajectories per forward/backward on one device (ignored when use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of a fixed count."""
    ppo_max_token_len_per_device: int = 32768
    """Token budget of one micro-batch per device when use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over each step's trajectories."""
    cliprange_value: float = 0.5
    """Clip of the value update around the old values."""
    offload: bool = False
    """Colocated: hold the critic's parameters, gradients and optimizer state in host memory while the
    engines generate."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Not supported: a value model trains every weight (its head is new); `rank` must stay 0."""


@dataclass(kw_only=True, slots=True)
class RefConfig:
    megatron: MegatronConfig | None = None
    """Parallel layout of the frozen reference; None = the actor's layout, in the actor's processes (no processes,
    process groups or device context of its own); set: a worker group of its own on this layout."""
    log_prob_micro_batch_size_per_device: int | None = None
    """Trajectories per forward; None = actor.log_prob_micro_batch_size_per_device."""
    offload: bool = False
    """Colocated: hold the reference's parameters in host memory while the engines generate."""


def router_replay_problems(actor: ActorConfig, num_experts: int, engines_return_routing: bool) -> list[str]:
    """Problems of `actor.router_replay` for a model with `num_experts` routed experts per MoE layer, with engines
    that return routed experts or not (`rollout.return_routed_experts`)."""
    mode = actor.router_replay
    if mode not in ROUTER_REPLAY_MODES:
        return [f"actor.router_replay={mode!r} is unknown; choose one of {', '.join(ROUTER_REPLAY_MODES)}"]
    if mode == "disabled":
        return []
    problems = []
    if num_experts == 0:
        problems.append(f"actor.router_replay={mode} needs a MoE model; model.path has no experts (set disabled)")
    if mode == "R3" and not engines_return_routing:
        problems.append("actor.router_replay=R3 replays the engines' routing: set rollout.return_routed_experts=true")
    return problems
