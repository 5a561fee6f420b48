"""The gate: one check of the whole config before anything is spawned (the CLI runs it).

`validate(cfg)` collects every problem it finds and raises a single `ConfigError` (a
`ValueError`) with one line per problem; each line names the field(s) involved and the fix.
It covers: names chosen from fixed sets, files that must exist (and the prompts the data files must
hold: `megarl.data.checks`), prompt+response length vs the model's context, parallel sizes vs the
model (heads, layers, experts) and the devices, the batch-size algebra (see `megarl.plan.facts.BatchSizes`), and
LoRA (`actor.lora`: what its targets adapt of the model, `megarl.plan.lora`), and the reward models (`reward_model`:
their pools, layout and checkpoints, `megarl.plan.reward_models`).
Each config group's own checks live beside its schema in `megarl.config`; this module adds what crosses groups
and what needs the behaviour packages (estimator and loss names, data files).
"""

from collections.abc import Sequence
from pathlib import Path

from megarl import algo
from megarl.config import agents, data, rollout, sync, trainer
from megarl.config.async_training import async_problems
from megarl.config.layout import ConfigError, ModelFacts, check_layout, read_model_facts
from megarl.config.lora import MIXTRAL_EXPERT_TARGETS, lora_problems
from megarl.config.root import MegarlConfig
from megarl.config.training import OPTIMIZER_NAMES, TRANSFORMER_IMPLS, router_replay_problems
from megarl.data.checks import data_file_problems
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.checkpoints import quantized_checkpoint_problems
from megarl.plan.distill import distill_gate_problems
from megarl.plan.facts import batch_sizes, critic_enabled, estimator_traits, rollout_devices, training_devices
from megarl.plan.lora import lora_model_problems
from megarl.plan.reward_models import reward_gate_problems
from megarl.plan.sft import mode_problems, sft_file_problems, sft_length_problems
from megarl.plugins import import_callable


def validate(cfg: MegarlConfig, check_files: bool = True) -> None:
    """Raise `ConfigError` listing every problem in `cfg`; return quietly when it can run.

    `check_files=False` skips data, tokenizer, weight and checkpoint files (planning on a laptop).
    """
    problems = _check_names(cfg) + _check_counts(cfg) + _check_algorithm(cfg) + _check_async(cfg)
    problems += _check_files(cfg) if check_files else []
    problems += reward_gate_problems(cfg, check_files) + mode_problems(cfg) + distill_gate_problems(cfg, check_files)
    roles = ["actor", "critic"] if critic_enabled(cfg) else ["actor"]
    try:
        facts: ModelFacts | None = read_model_facts(cfg.model.path)
    except ConfigError as err:
        facts = None
        problems.append(str(err))
    # layouts are checked when both pools have devices; else trainer.placement_problems says why
    devices = training_devices(cfg)
    layout_facts = facts if devices >= 1 and rollout_devices(cfg) >= 1 else None
    for role in roles:
        mp = cfg.actor.megatron if role == "actor" else cfg.critic.megatron
        layout = [] if layout_facts is None else check_layout(f"{role}.megatron", mp, layout_facts, devices)
        problems += layout + _check_batch_sizes(cfg, role, check_dp=layout_facts is not None and not layout)
    problems += _check_lora(cfg, model_read=facts is not None)
    if facts is not None:
        problems += _check_lengths(cfg, facts)
        problems += router_replay_problems(cfg.actor, facts.num_experts, cfg.rollout.return_routed_experts)
    if layout_facts is not None:
        problems += _check_rollout_layout(cfg, layout_facts)
        if cfg.ref.megatron is not None:
            problems += check_layout("ref.megatron", cfg.ref.megatron, layout_facts, devices)
    if problems:
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        raise ConfigError(f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}")


def _choice(field: str, value: str, choices: Sequence[str], extensible: bool = False) -> list[str]:
    if value in choices:
        return []
    if extensible and (":" in value or "." in value):
        try:
            import_callable(value)
        except ValueError as err:
            return [f"{field}={value!r}: {err}; give `package.module:function` on PYTHONPATH"]
        return []
    more = " or `package.module:function`" if extensible else ""
    return [f"{field}={value!r} is unknown; choose one of {', '.join(choices)}{more}"]


def _check_names(cfg: MegarlConfig) -> list[str]:
    alg = cfg.algorithm
    problems = (
        _choice("algorithm.adv_estimator", alg.adv_estimator, algo.ADVANTAGE_ESTIMATORS.names(), extensible=True)
        + _choice("algorithm.policy_loss", alg.policy_loss, algo.POLICY_LOSSES.names(), extensible=True)
        + _choice("algorithm.loss_agg_mode", alg.loss_agg_mode, algo.LOSS_AGG_MODES)
        + _choice("algorithm.kl_loss_type", alg.kl_loss_type, algo.KL_ESTIMATORS.names())
        + _choice("algorithm.kl_penalty", alg.kl_penalty, algo.KL_ESTIMATORS.names())
        + _choice("algorithm.kl_ctrl.type", alg.kl_ctrl.type, algo.KL_CONTROLLERS)
        + _choice("rollout.engine", cfg.rollout.engine, rollout.ENGINES)
        + _choice("rollout.load_format", cfg.rollout.load_format, rollout.LOAD_FORMATS)
        + _choice("rollout.dtype", cfg.rollout.dtype, ("auto", "bfloat16", "float16", "float32"))
        + _choice("data.truncation", cfg.data.truncation, data.TRUNCATIONS)
        + _choice("trainer.device", cfg.trainer.device, trainer.DEVICES)
        + _choice("trainer.placement", cfg.trainer.placement, trainer.PLACEMENTS)
        + _choice("trainer.driver", cfg.trainer.driver, trainer.DRIVERS)
        + _choice("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16"))
        + _choice("sync.transport", cfg.sync.transport, sync.TRANSPORTS)
        + _choice("sync.backend", cfg.sync.backend, sync.BACKENDS)
        + _choice("sync.tensor_format", cfg.sync.tensor_format, sync.TENSOR_FORMATS)
    )
    for name in cfg.trainer.logger:
        problems += _choice("trainer.logger", name, trainer.LOGGERS)
    for role, optim, megatron in (
        ("actor", cfg.actor.optim, cfg.actor.megatron),
        ("critic", cfg.critic.optim, cfg.critic.megatron),
    ):
        problems += _choice(f"{role}.optim.name", optim.name, OPTIMIZER_NAMES)
        if optim.name == "sgd" and megatron.use_distributed_optimizer:
            problems.append(
                f"{role}.optim.name=sgd cannot use megatron's distributed optimizer (adam only); "
                f"set {role}.megatron.use_distributed_optimizer=false"
            )
    for role, megatron_cfg in (
        ("actor", cfg.actor.megatron),
        ("critic", cfg.critic.megatron),
        ("ref", cfg.ref.megatron),
    ):
        if megatron_cfg is None:
            continue
        field = f"{role}.megatron.transformer_impl"
        problems += _choice(field, megatron_cfg.transformer_impl, TRANSFORMER_IMPLS)
        if megatron_cfg.transformer_impl == "transformer_engine" and cfg.trainer.device == "cpu":
            problems.append(f"{field}=transformer_engine needs GPUs but trainer.device=cpu; use local or auto")
    if cfg.rollout.engine == "sglang" and cfg.trainer.device == "cpu":
        problems.append("rollout.engine=sglang needs GPUs but trainer.device=cpu; use rollout.engine=embedded on CPU")
    return problems


def _check_counts(cfg: MegarlConfig) -> list[str]:
    positive = {
        "data.train_batch_size": cfg.data.train_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "rollout.n": cfg.rollout.n,
        "rollout.val.n": cfg.rollout.val.n,
        "rollout.tensor_parallel_size": cfg.rollout.tensor_parallel_size,
        "rollout.data_parallel_size": cfg.rollout.data_parallel_size,
        "rollout.pipeline_parallel_size": cfg.rollout.pipeline_parallel_size,
        "rollout.expert_parallel_size": cfg.rollout.expert_parallel_size,
        "actor.ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size,
        "actor.ppo_micro_batch_size_per_device": cfg.actor.ppo_micro_batch_size_per_device,
        "actor.ppo_epochs": cfg.actor.ppo_epochs,
        "trainer.nnodes": cfg.trainer.nnodes,
        "trainer.devices_per_node": cfg.trainer.devices_per_node,
        "trainer.total_epochs": cfg.trainer.total_epochs,
    }
    problems = [f"{name}={value} must be >= 1" for name, value in positive.items() if value < 1]
    problems += sync.problems(cfg.sync, cfg.trainer.placement, cfg.trainer.device, cfg.rollout)
    if cfg.trainer.total_training_steps is not None and cfg.trainer.total_training_steps < 1:
        problems.append("trainer.total_training_steps must be >= 1, or null for total_epochs × steps per epoch")
    if not 0 < cfg.rollout.top_p <= 1:
        problems.append(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if cfg.rollout.temperature < 0:
        problems.append(f"rollout.temperature={cfg.rollout.temperature} must be >= 0 (0 = greedy)")
    problems += rollout.val_sampling_problems(cfg.rollout.val)
    problems += _reward_weight_problems(cfg.algorithm.adv_estimator, cfg.algorithm.reward_weights)
    if estimator_traits(cfg.algorithm.adv_estimator).uses_groups and cfg.rollout.n == 1:
        problems.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of one prompt: "
            f"set rollout.n >= 2 (it is {cfg.rollout.n})"
        )
    return problems + trainer.placement_problems(cfg.trainer) + trainer.guard_problems(cfg.trainer)


def _check_async(cfg: MegarlConfig) -> list[str]:
    """`async_training.*` on its own, then what the fully asynchronous producer does not do."""
    t = cfg.trainer
    problems = async_problems(cfg.async_training, t.driver, t.placement, cfg.data.train_batch_size)
    if t.driver == "fully_async" and cfg.algorithm.filter_groups.enable:
        problems.append(
            "trainer.driver=fully_async rolls out each prompt once per epoch, so DAPO dynamic sampling "
            "(algorithm.filter_groups.enable) cannot draw more; use one_step_off or disable the filter"
        )
    if t.driver == "fully_async" and "baseline_scores" in estimator_traits(cfg.algorithm.adv_estimator).needs:
        problems.append(
            f"trainer.driver=fully_async does not roll out greedy baselines for "
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}; use one_step_off or another estimator"
        )
    return problems


def _reward_weight_problems(estimator: str, weights: dict[str, float]) -> list[str]:
    """gdpo (any estimator that reads reward components) needs `algorithm.reward_weights`; no other reads them."""
    reads = "reward_components" in estimator_traits(estimator).needs
    if reads and not weights:
        return [
            f"algorithm.adv_estimator={estimator} combines several rewards: set algorithm.reward_weights to "
            "component → weight, components named as in the reward function's RewardResult.extra "
            "(e.g. +algorithm.reward_weights.acc=1.0 +algorithm.reward_weights.format_ok=0.5)"
        ]
    if weights and not reads:
        return [f"algorithm.reward_weights is read only by gdpo, not algorithm.adv_estimator={estimator}; remove it"]
    return []


def _check_algorithm(cfg: MegarlConfig) -> list[str]:
    alg = cfg.algorithm
    ranges = {
        "algorithm.gamma": (alg.gamma, 0.0 <= alg.gamma <= 1.0, "in [0, 1]"),
        "algorithm.lam": (alg.lam, 0.0 <= alg.lam <= 1.0, "in [0, 1]"),
        "algorithm.clip_ratio_low": (alg.clip_ratio_low, 0.0 <= alg.clip_ratio_low < 1.0, "in [0, 1)"),
        "algorithm.clip_ratio_high": (alg.clip_ratio_high, alg.clip_ratio_high >= 0.0, ">= 0"),
        "algorithm.clip_ratio_c": (alg.clip_ratio_c, alg.clip_ratio_c > 1.0, "> 1 (dual-clip bound)"),
        "algorithm.rollout_is_cap": (alg.rollout_is_cap, alg.rollout_is_cap is None or alg.rollout_is_cap > 0, "> 0"),
        "critic.cliprange_value": (cfg.critic.cliprange_value, cfg.critic.cliprange_value > 0, "> 0 (inf = off)"),
    }
    problems = [f"{name}={value} must be {rule}" for name, (value, ok, rule) in ranges.items() if not ok]
    if alg.kl_ctrl.type == "adaptive" and (alg.kl_ctrl.target_kl <= 0 or alg.kl_ctrl.horizon < 1):
        problems.append(
            f"algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl > 0 and kl_ctrl.horizon >= 1 "
            f"(got {alg.kl_ctrl.target_kl}, {alg.kl_ctrl.horizon})"
        )
    if alg.filter_groups.enable and alg.filter_groups.metric != "score":
        problems.append(f"algorithm.filter_groups.metric={alg.filter_groups.metric!r}: only score is supported")
    problems += algo.loss_param_problems(alg)
    problems += algo.rollout_correction_problems(alg)
    buffer = alg.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= cfg.data.max_response_length:
        problems.append(
            f"algorithm.overlong_buffer.len={buffer.len} must be in [1, data.max_response_length="
            f"{cfg.data.max_response_length}]"
        )
    return problems


def _check_files(cfg: MegarlConfig) -> list[str]:
    sft = cfg.trainer.mode == "sft"
    problems = sft_file_problems(cfg) if sft else data_file_problems(cfg.data, cfg.reward.function)
    tokenizer_dir = Path(cfg.model.tokenizer_path or cfg.model.path)
    if not (tokenizer_dir / "tokenizer.json").is_file() and not (tokenizer_dir / "tokenizer_config.json").is_file():
        problems.append(f"model.tokenizer_path: no tokenizer files in {tokenizer_dir}; set model.tokenizer_path")
    if not cfg.model.random_init and not any(Path(cfg.model.path).glob("*.safetensors")):
        problems.append(
            f"model.path: no *.safetensors in {cfg.model.path}; give a directory with weights "
            "or set model.random_init=true"
        )
    problems += quantized_checkpoint_problems(cfg)
    problems += agents.openai_agent_problems(cfg.agents.openai, cfg.rollout.default_agent)
    return problems + rollout.multi_turn_problems(cfg.rollout) + trainer.resume_problems(cfg.trainer)


def _check_lora(cfg: MegarlConfig, model_read: bool) -> list[str]:
    """`actor.lora` on its own and against the actor's TP, `critic.lora`, and what the targets adapt of the model."""
    lora, tp = cfg.actor.lora, cfg.actor.megatron.tensor_model_parallel_size
    problems = lora_problems(lora)
    if cfg.critic.lora.rank != 0:
        problems.append(
            f"critic.lora.rank={cfg.critic.lora.rank}: LoRA trains the actor only; a value model trains every weight: "
            "set critic.lora.rank=0"
        )
    if not lora.enabled:
        return problems
    if lora.dropout > 0 and tp > 1:
        problems.append(
            f"actor.lora.dropout={lora.dropout} with actor.megatron.tensor_model_parallel_size={tp}: an adapter's "
            "input is replicated over the TP ranks, so its dropout would need a TP-synchronised RNG; set "
            "actor.lora.dropout=0 or actor.megatron.tensor_model_parallel_size=1"
        )
    if cfg.ref.megatron is not None:
        problems.append(
            "ref.megatron is set but actor.lora.rank > 0: a LoRA actor's reference is the actor with its adapters off "
            "(no model or processes of its own); unset ref.megatron"
        )
    problems += _lora_serving_problems(cfg) + _lora_export_problems(cfg)
    if not model_read or not lora.target_modules:
        return problems
    try:
        spec = model_spec(load_hf_config(cfg.model.path))
    except ValueError as err:
        return [*problems, f"model.path: {err}"]
    return problems + lora_model_problems(cfg, spec)


def _lora_export_problems(cfg: MegarlConfig) -> list[str]:
    """An HF export of a LoRA actor merges its adapters into model.path's weights: a random-init model has none."""
    wanted = ["trainer.save_hf_weights"] if cfg.trainer.save_hf_weights else []
    wanted += ["sft.hf_output"] if cfg.trainer.mode == "sft" and cfg.sft.hf_output is not None else []
    if not cfg.model.random_init or not wanted:
        return []
    return [
        f"{' and '.join(wanted)} with actor.lora.rank > 0 and model.random_init=true: the HF export merges the "
        "adapters into model.path's weights, which a random-init model does not have on disk; point model.path at "
        "a checkpoint with weights, or turn the export off"
    ]


def _lora_serving_problems(cfg: MegarlConfig) -> list[str]:
    """`sync=adapter` loads each step's adapter into engines megarl starts with --enable-lora (at actor.lora.rank, on
    its targets): `rollout.engine_kwargs` must not undo that, and SGLang must take the targets."""
    lora, kwargs = cfg.actor.lora, cfg.rollout.engine_kwargs
    if lora.sync != "adapter":
        return []
    fix = "drop it from rollout.engine_kwargs or set actor.lora.sync=merged"
    problems = []
    if "enable_lora" in kwargs and not kwargs["enable_lora"]:
        problems.append(
            f"rollout.engine_kwargs.enable_lora={kwargs['enable_lora']}: actor.lora.sync=adapter loads each step's "
            f"adapter into engines started with --enable-lora; {fix}"
        )
    max_rank = kwargs.get("max_lora_rank")
    if max_rank is not None and int(max_rank) < lora.rank:
        problems.append(
            f"rollout.engine_kwargs.max_lora_rank={max_rank} < actor.lora.rank={lora.rank}: the engines would refuse "
            f"the adapter; {fix}"
        )
    experts = [name for name in lora.target_modules if name in MIXTRAL_EXPERT_TARGETS]
    if experts and cfg.rollout.engine == "sglang":
        problems.append(
            f"actor.lora.target_modules has {experts}: SGLang 0.5.23's --lora-target-modules takes no Mixtral expert "
            "projections; set actor.lora.sync=merged or leave them out"
        )
    return problems


def _check_lengths(cfg: MegarlConfig, facts: ModelFacts) -> list[str]:
    limit = cfg.model.max_model_len or facts.max_position_embeddings
    if cfg.trainer.mode == "sft":
        return sft_length_problems(cfg, limit)
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if total <= limit:
        return []
    return [
        f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's context of {limit} "
        "(model.max_model_len, or max_position_embeddings in config.json); shorten them"
    ]


def _check_rollout_layout(cfg: MegarlConfig, facts: ModelFacts) -> list[str]:
    r = cfg.rollout
    tp, per_replica = r.tensor_parallel_size, r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size
    devices = rollout_devices(cfg)
    problems = []
    if per_replica >= 1 and devices % per_replica:
        problems.append(
            f"rollout tensor×data×pipeline_parallel_size = {tp}×{r.data_parallel_size}×{r.pipeline_parallel_size} "
            f"must divide the {devices} rollout devices"
        )
    if r.expert_parallel_size >= 1 and tp % r.expert_parallel_size:
        problems.append(
            f"rollout.expert_parallel_size={r.expert_parallel_size} must divide rollout.tensor_parallel_size={tp} "
            "(SGLang spreads experts over the replica's TP ranks)"
        )
    if r.engine == "embedded" and per_replica != 1:
        problems.append(
            "rollout.engine=embedded runs one device per replica; set rollout.tensor_parallel_size, "
            "data_parallel_size and pipeline_parallel_size to 1 (or use rollout.engine=sglang)"
        )
    if tp >= 1 and facts.num_heads % tp:
        problems.append(f"rollout.tensor_parallel_size={tp} must divide the model's {facts.num_heads} attention heads")
    return problems


def _check_batch_sizes(cfg: MegarlConfig, role: str, check_dp: bool) -> list[str]:
    rc = cfg.actor if role == "actor" else cfg.critic
    prompts, n, mini = cfg.data.train_batch_size, cfg.rollout.n, rc.ppo_mini_batch_size
    if min(prompts, n, mini, rc.ppo_micro_batch_size_per_device) < 1:
        return []
    if prompts % mini:
        divisors = [d for d in range(1, prompts + 1) if prompts % d == 0]
        return [
            f"{role}.ppo_mini_batch_size={mini} prompts ({mini * n} trajectories with rollout.n={n}) must divide "
            f"data.train_batch_size={prompts} prompts ({prompts * n} trajectories per step); "
            f"set {role}.ppo_mini_batch_size to one of {divisors} or change data.train_batch_size"
        ]
    if rc.use_dynamic_bsz:
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        if rc.ppo_max_token_len_per_device < longest:
            return [
                f"{role}.ppo_max_token_len_per_device={rc.ppo_max_token_len_per_device} is below one full "
                f"trajectory (data.max_prompt_length + data.max_response_length = {longest}); raise it"
            ]
        return []
    if not check_dp:
        return []
    sizes = batch_sizes(cfg, role)
    if sizes.trajectories_per_mini_batch % sizes.dp:
        return [
            f"a mini-batch of {role}.ppo_mini_batch_size × rollout.n = {mini}×{n} = "
            f"{sizes.trajectories_per_mini_batch} "
            f"trajectories does not split over the {role}'s {sizes.dp} data-parallel ranks; change them or set "
            f"{role}.use_dynamic_bsz=true"
        ]
    assert sizes.trajectories_per_device is not None
    if sizes.trajectories_per_device % rc.ppo_micro_batch_size_per_device:
        return [
            f"{role}.ppo_micro_batch_size_per_device={rc.ppo_micro_batch_size_per_device} must divide the "
            f"{sizes.trajectories_per_device} trajectories each of the {sizes.dp} data-parallel ranks gets per "
            f"mini-batch ({role}.ppo_mini_batch_size × rollout.n ÷ DP)"
        ]
    return []
