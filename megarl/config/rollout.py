"""Rollout: the generation engine, its replicas and sampling."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("embedded", "sglang")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    n: int = 1
    """Samples per prompt; above 1, validation reports mean@n, pass@k, best@k, worst@k and maj@k
    (docs/trainer.md) and needs a temperature above 0."""


TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass(kw_only=True, slots=True)
class MultiTurnConfig:
    tool_config_path: str | None = None
    """YAML listing tools (`tools: [{class_name, config, tool_schema}]`); schemas go into the chat template."""
    interaction_config_path: str | None = None
    """YAML listing interactions (`interactions: [{name, class_name, config}]`): simulated users / environments."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from the model's text: a registered name (hermes) or `package.module:Class`."""
    max_assistant_turns: int | None = None
    """Model turns per trajectory at most; None = until the response budget or a final answer."""
    max_user_turns: int | None = None
    """Tool-response and interaction turns per trajectory at most; None = no limit."""
    max_new_tokens_per_turn: int | None = None
    """Tokens one model turn may generate at most (a cut turn is closed and parsed like any other);
    None = the rest of the response budget."""
    max_parallel_calls: int = 1
    """Tool calls executed per model turn; further calls in the same turn are ignored."""
    max_tool_response_length: int = 256
    """Characters of one tool response kept; longer ones are cut (`tool_response_truncate_side`)."""
    tool_response_truncate_side: str = "middle"
    """left keeps the end, right keeps the start, middle keeps both ends."""
    tool_timeout_s: float = 60.0
    """Seconds one tool call may take; a late call becomes an error message for the model."""
    continue_on_tool_error: bool = True
    """Malformed calls, unknown tools and tool failures become error messages and the trajectory goes on;
    false = the trajectory ends at the first such error."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "embedded"
    """embedded (transformers + torch server speaking SGLang's protocol; CPU or one GPU) | sglang."""
    n: int = 1
    """Samples per prompt during training (the GRPO group size)."""
    temperature: float = 1.0
    """Training-time sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Training-time nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Training-time top-k; -1 = all."""
    tensor_parallel_size: int = 1
    """SGLang --tp-size. Devices per replica = tp × dp × pp; replicas = rollout devices ÷ that."""
    data_parallel_size: int = 1
    """SGLang --dp-size: data-parallel copies inside one replica (one HTTP endpoint)."""
    pipeline_parallel_size: int = 1
    """SGLang --pp-size."""
    expert_parallel_size: int = 1
    """SGLang --ep-size (MoE): experts spread over this many of the replica's devices."""
    dtype: str = "auto"
    """Engine weight dtype: auto (the checkpoint's) | bfloat16 | float16 | float32."""
    load_format: str = "auto"
    """auto (read the checkpoint) | dummy (random weights, replaced by the first weight sync; colocated start)."""
    mem_fraction_static: float = 0.6
    """SGLang --mem-fraction-static: device memory share for weights + KV cache."""
    enable_memory_saver: bool = True
    """Release weights and KV cache while the trainer holds the device (colocated)."""
    enable_weights_cpu_backup: bool = False
    """Keep weight values across sleep/wake (not needed when a weight sync follows every wake)."""
    return_routed_experts: bool = False
    """Engines record which experts each MoE layer routes every token to and return them when asked (SGLang
    --enable-return-routed-experts), for routing replay (R3)."""
    enable_cuda_graph: bool = True
    """SGLang CUDA graphs for decoding (false = --disable-cuda-graph)."""
    deterministic_inference: bool = False
    """Batch-invariant inference: a request's tokens and log-probs do not depend on what it is batched with, so
    seeded runs repeat bit for bit on the same machine (SGLang --enable-deterministic-inference; the embedded
    engine decodes each sequence alone, without its prefix cache)."""
    attention_backend: str | None = None
    """SGLang --attention-backend (fa3, flashinfer, triton, ...); None = SGLang's choice."""
    max_running_requests: int | None = None
    """Requests decoded together per replica at most; None = the engine's default."""
    server_start_timeout_s: float = 900.0
    """Seconds a replica may take to load and warm up before launch fails with its log tail."""
    request_timeout_s: float = 1800.0
    """Seconds one /generate call may take before it is treated as a dead replica."""
    health_check_interval_s: float = 10.0
    """Seconds between the router's health checks of every replica."""
    max_engine_restarts_per_replica: int = 3
    """Restarts of one replica that died or hung (each followed by a full weight sync) before the run stops."""
    max_engine_restarts: int = 10
    """Replica restarts over the whole run before it stops; 0 = never restart (a lost replica stops the run)."""
    default_agent: str = "single_turn"
    """Agent loop for rows without an `agent_name`: single_turn | tool_agent | openai (agents.openai.agent) |
    `package.module:Class`."""
    num_agent_workers: int = 1
    """Ray actors (CPU only, spread over nodes) that run the agent loops; each runs its rows concurrently."""
    val: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Sampling during validation: greedy, one sample per prompt by default (n > 1 needs temperature > 0)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool-using agent loops."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra engine arguments passed through unchanged (e.g. SGLang's attention_backend)."""


def val_sampling_problems(val: SamplingConfig) -> list[str]:
    """What is wrong with `rollout.val.*`, each naming its key and the fix."""
    problems = []
    if val.temperature < 0:
        problems.append(f"rollout.val.temperature={val.temperature} must be >= 0 (0 = greedy)")
    if not 0 < val.top_p <= 1:
        problems.append(f"rollout.val.top_p={val.top_p} must be in (0, 1]")
    if val.n > 1 and val.temperature == 0:
        problems.append(
            f"rollout.val.n={val.n} greedy samples would all be the same; set rollout.val.temperature > 0 "
            "(e.g. 1.0) or rollout.val.n=1"
        )
    return problems


def multi_turn_problems(cfg: RolloutConfig) -> list[str]:
    """What is wrong with the agent-loop settings, each naming its `rollout.*` key and the fix."""
    mt, problems = cfg.multi_turn, []
    for key in ("tool_config_path", "interaction_config_path"):
        path = getattr(mt, key)
        if path is not None and not Path(path).is_file():
            problems.append(f"rollout.multi_turn.{key}: {path} does not exist")
    for key in ("max_assistant_turns", "max_user_turns", "max_new_tokens_per_turn"):
        value = getattr(mt, key)
        if value is not None and value < 1:
            problems.append(f"rollout.multi_turn.{key}={value} must be >= 1 or null (no limit)")
    if mt.max_parallel_calls < 1:
        problems.append(f"rollout.multi_turn.max_parallel_calls={mt.max_parallel_calls} must be >= 1")
    if mt.max_tool_response_length < 1:
        problems.append(f"rollout.multi_turn.max_tool_response_length={mt.max_tool_response_length} must be >= 1")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        problems.append(
            f"rollout.multi_turn.tool_response_truncate_side={mt.tool_response_truncate_side!r} is unknown; "
            f"choose one of {list(TRUNCATE_SIDES)}"
        )
    if mt.tool_timeout_s <= 0:
        problems.append(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s} must be > 0")
    if cfg.num_agent_workers < 1:
        problems.append(f"rollout.num_agent_workers={cfg.num_agent_workers} must be >= 1")
    return problems
