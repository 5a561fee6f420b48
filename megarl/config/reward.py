"""Model rewards (`reward_model.*`): a discriminative RM, a generative judge, a remote reward service.

Each enabled source scores every trajectory as one named component of its reward: `rule` (the rule function,
or the agent loop's own reward), `rm`, `judge`, `remote`. A trajectory's score is Σ weight × component;
every component lands in the row's `reward_extra` (metrics, GDPO's `algorithm.reward_weights`).
"""

from dataclasses import dataclass, field
from typing import Any

from megarl.config.training import MegatronConfig

ON_ERROR = ("fail", "skip_sample", "default_score")
RM_BACKENDS = ("megatron", "server")
JUDGE_PARSERS = ("number", "boxed", "yes_no")
REWARD_ENGINES = ("embedded", "sglang")
DEFAULT_JUDGE_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\n\nQuestion: {prompt}\n\nAnswer: {response}\n\n"
    "Reply with the rating only."
)
"""`reward_model.generative.prompt_template` by default: `{prompt}` (the last user message) and `{response}`;
`{ground_truth}` may also be used."""


@dataclass(kw_only=True, slots=True)
class RetryConfig:
    timeout_s: float = 60.0
    """One request's limit."""
    max_retries: int = 3
    """Tries after the first before the sample gets `reward_model.on_error`."""
    backoff_s: float = 0.5
    """Wait before the first retry; doubled each retry (with up to 10% jitter)."""
    max_backoff_s: float = 8.0
    """Longest wait between tries."""


@dataclass(kw_only=True, slots=True)
class RewardEnginesConfig:
    """The engine replicas a reward model runs on: its own pool of devices, or servers already running."""

    engine: str = "embedded"
    """embedded (the CPU/torch engine) | sglang."""
    devices: int = 1
    """Devices of the pool (taken from nnodes × devices_per_node before the trainer's and rollout's); replicas =
    devices ÷ tensor_parallel_size. Ignored when `urls` is set."""
    tensor_parallel_size: int = 1
    """Devices per replica (sglang)."""
    urls: list[str] = field(default_factory=list)
    """Servers already running (`http://host:port`), used instead of launching a pool."""
    dtype: str = "auto"
    """Weights' dtype on the engines; auto = model.dtype."""
    mem_fraction_static: float = 0.8
    """sglang: fraction of device memory for weights and KV cache."""
    server_start_timeout_s: float = 900.0
    """How long a replica may take to answer /health."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra server flags (`--key value`)."""


@dataclass(kw_only=True, slots=True)
class DiscriminativeRMConfig:
    enable: bool = False
    path: str | None = None
    """An HF `*ForSequenceClassification` checkpoint (num_labels=1, a `score` head) of a shipped family."""
    tokenizer_path: str | None = None
    """The RM's tokenizer and chat template; None = `path`'s."""
    backend: str = "megatron"
    """megatron (a Megatron role on the trainer's devices, offloaded while the engines generate; scores a step's
    trajectories after rollout) | server (SGLang `/classify` replicas of its own, `engines`; scores each trajectory
    as it finishes)."""
    weight: float = 1.0
    """Weight of the `rm` component in the score."""
    max_length: int = 4096
    """Tokens of the formatted conversation the RM reads; longer ones keep their last max_length tokens."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the RM's chat template."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """backend=megatron: the RM's layout (TP/PP; DP = the rest of the trainer's devices)."""
    micro_batch_size: int = 4
    """backend=megatron: rows per forward micro-batch."""
    offload: bool = True
    """backend=megatron: keep the RM's weights off the device except while it scores."""
    engines: RewardEnginesConfig = field(default_factory=RewardEnginesConfig)
    """backend=server: the `/classify` replicas."""
    concurrency: int = 64
    """backend=server: requests in flight per agent worker."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """backend=server: timeouts and retries."""


@dataclass(kw_only=True, slots=True)
class GenerativeRMConfig:
    enable: bool = False
    path: str | None = None
    """The judge: an HF causal LM checkpoint (a shipped family)."""
    tokenizer_path: str | None = None
    """The judge's tokenizer and chat template; None = `path`'s."""
    random_init: bool = False
    """Serve the judge with random weights (`path` holds only a config: tests and dry runs)."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The user message sent to the judge: `{prompt}` and `{response}` required, `{ground_truth}` optional."""
    system_prompt: str | None = None
    """An optional system message before it."""
    parser: str = "number"
    """number (the last number in the reply, scaled from score_range to [0, 1]) | boxed (the last \\boxed{x}, scaled
    the same way) | yes_no (P(yes) / (P(yes) + P(no)) from the first reply token's log-probs)."""
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """number/boxed: the judge's scale, mapped onto [0, 1] (values outside are clipped)."""
    yes_no_tokens: list[str] = field(default_factory=lambda: ["Yes", "No"])
    """yes_no: the tokens whose log-probs decide."""
    temperature: float = 0.0
    """Sampling temperature of the judge."""
    samples: int = 1
    """Judgements per trajectory, averaged."""
    max_new_tokens: int = 64
    """Longest judge reply."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the judge's chat template."""
    weight: float = 1.0
    """Weight of the `judge` component in the score."""
    engines: RewardEnginesConfig = field(default_factory=RewardEnginesConfig)
    """The judge's replicas."""
    concurrency: int = 32
    """Judge requests in flight per agent worker."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """Timeouts and retries; an unparsable reply counts as a failed try."""


@dataclass(kw_only=True, slots=True)
class RemoteRMConfig:
    url: str | None = None
    """POST endpoint of a reward service (JSON in, JSON out; `megarl/scoring/remote.py`); None = off."""
    weight: float = 1.0
    """Weight of the `remote` component in the score."""
    auth_env: str | None = None
    """Environment variable holding a token sent as `Authorization: Bearer <token>`; None = no header."""
    concurrency: int = 32
    """Requests in flight per agent worker."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """Timeouts and retries (HTTP 5xx, 429, connection errors, timeouts; a 4xx other than 429 fails at once)."""


@dataclass(kw_only=True, slots=True)
class RewardModelConfig:
    discriminative: DiscriminativeRMConfig = field(default_factory=DiscriminativeRMConfig)
    generative: GenerativeRMConfig = field(default_factory=GenerativeRMConfig)
    remote: RemoteRMConfig = field(default_factory=RemoteRMConfig)
    rule_weight: float = 1.0
    """Weight of the `rule` component (the rule function, or the agent loop's reward); 0 = model rewards only."""
    on_error: str = "fail"
    """A source that still fails after its retries: fail (stop the run, naming the sample and source) | skip_sample
    (the trajectory is trained on by nobody: its response mask is zeroed, its score set to its group's mean) |
    default_score (the source scores `default_score`). Counted in `reward/errors`."""
    default_score: float = 0.0
    """The component's value under on_error=default_score."""

    @property
    def uses_models(self) -> bool:
        """Any model or service scores trajectories."""
        return self.discriminative.enable or self.generative.enable or self.remote.url is not None


def reward_model_problems(cfg: RewardModelConfig) -> list[str]:
    """Named problems of `reward_model.*` alone (paths, names, ranges, the judge template)."""
    problems = []
    if cfg.on_error not in ON_ERROR:
        problems.append(f"reward_model.on_error={cfg.on_error!r} is not one of {ON_ERROR}")
    rm, judge = cfg.discriminative, cfg.generative
    if rm.enable and rm.backend not in RM_BACKENDS:
        problems.append(f"reward_model.discriminative.backend={rm.backend!r} is not one of {RM_BACKENDS}")
    if rm.enable and not rm.path:
        problems.append(
            "reward_model.discriminative.enable needs reward_model.discriminative.path (an HF "
            "*ForSequenceClassification checkpoint)"
        )
    if judge.enable:
        problems += _judge_problems(judge)
    for name, engines in (("discriminative", rm.engines), ("generative", judge.engines)):
        if engines.engine not in REWARD_ENGINES:
            problems.append(f"reward_model.{name}.engines.engine={engines.engine!r} is not one of {REWARD_ENGINES}")
    if cfg.remote.url is not None and not cfg.remote.url.startswith(("http://", "https://")):
        problems.append(f"reward_model.remote.url={cfg.remote.url!r} is not an http(s) URL")
    return problems


def _judge_problems(judge: GenerativeRMConfig) -> list[str]:
    problems = []
    if not judge.path:
        problems.append("reward_model.generative.enable needs reward_model.generative.path (the judge's HF model)")
    missing = [key for key in ("{prompt}", "{response}") if key not in judge.prompt_template]
    if missing:
        problems.append(f"reward_model.generative.prompt_template lacks the placeholders {missing}")
    if judge.parser not in JUDGE_PARSERS:
        problems.append(f"reward_model.generative.parser={judge.parser!r} is not one of {JUDGE_PARSERS}")
    if len(judge.score_range) != 2 or judge.score_range[0] >= judge.score_range[1]:
        problems.append(f"reward_model.generative.score_range={judge.score_range} is not [low, high] with low < high")
    if judge.samples < 1:
        problems.append(f"reward_model.generative.samples={judge.samples} must be >= 1")
    return problems
