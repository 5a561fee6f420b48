"""The reward models (`reward_model.*`) against the rest of the run: their devices, the Megatron RM's layout and
memory, their checkpoints, and their lines in `megarl-plan` (the distillation teacher's lines and memory too; its
gate is `megarl.plan.distill`).

`reward_gate_problems(cfg, check_files)` is what the gate (`megarl.plan.gate.validate`) checks of them: the group's
own problems (`megarl.config.reward.reward_model_problems`), then what crosses groups. The pools' sizes are
`megarl.plan.facts.reward_pool_devices`; `reward_model_sizes` reads each model's config.json for the plan.
"""

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.layout import TRAINING_DEVICES, ConfigError, check_layout, read_model_facts
from megarl.config.reward import RewardEnginesConfig, reward_model_problems
from megarl.config.root import MegarlConfig
from megarl.config.training import MegatronConfig
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.facts import reward_pool_devices, training_devices
from megarl.plan.memory import DTYPE_BYTES, RoleMemory
from megarl.plan.params import DeviceShard, count_params, device_shard

CLASSIFIER_SUFFIX = "ForSequenceClassification"
RM = "reward_model.discriminative"
JUDGE = "reward_model.generative"
TEACHER = "algorithm.distillation.teacher"
POOL_FIELDS = {"judge": JUDGE, "classifier": RM, "teacher": TEACHER}
"""Each reward pool (`reward_pool_devices`) and the config group that sizes it."""
SHORT_NAMES = {RM: "rm", JUDGE: "judge", TEACHER: "teacher"}
"""The plan's name of each frozen model: its row in the memory table and its line."""


@dataclass(frozen=True, slots=True)
class RewardModelSize:
    """What the plan shows of one reward model, read from its config.json."""

    field: str
    """Its config group: reward_model.discriminative, reward_model.generative or algorithm.distillation.teacher."""
    path: str
    params: int
    """The whole model's parameters (a classifier: a 1-wide score head instead of the LM head)."""
    shard: DeviceShard | None
    """On Megatron (the RM's or the teacher's backend=megatron): the parameters of its fullest device; else None."""


def reward_gate_problems(cfg: MegarlConfig, check_files: bool) -> list[str]:
    """Named problems of `reward_model.*`: its own, its pools against the devices, what it cannot run with, and
    (with `check_files`, or whenever the config.json is there) its checkpoints."""
    problems = reward_model_problems(cfg.reward_model) + _device_problems(cfg) + _conflict_problems(cfg)
    for field, path in _model_paths(cfg).items():
        problems += _checkpoint_problems(cfg, field, path, check_files)
    return problems + (_service_problems(cfg) if check_files else [])


def _service_problems(cfg: MegarlConfig) -> list[str]:
    """What only the judge's tokenizer and the remote service can tell before anything starts: the template
    formats, the judge's yes/no tokens, the service's token variable and that its URL answers."""
    from megarl.scoring.judge import judge_problems
    from megarl.scoring.remote import remote_problems

    judge, remote = cfg.reward_model.generative, cfg.reward_model.remote
    problems = judge_problems(judge) if judge.enable and judge.path else []
    return problems + (asyncio.run(remote_problems(remote)) if remote.url is not None else [])


def _model_paths(cfg: MegarlConfig) -> dict[str, str]:
    """The enabled reward models with a path, by config group."""
    rm, judge = cfg.reward_model.discriminative, cfg.reward_model.generative
    paths = {JUDGE: judge.path} if judge.enable and judge.path else {}
    return paths | ({RM: rm.path} if rm.enable and rm.path else {})


def _engines(cfg: MegarlConfig, field: str) -> RewardEnginesConfig:
    if field == TEACHER:
        return cfg.algorithm.distillation.teacher.engines
    group = cfg.reward_model.discriminative if field == RM else cfg.reward_model.generative
    return group.engines


def _device_problems(cfg: MegarlConfig) -> list[str]:
    """Each pool holds whole replicas, and the pools, the rollout's and the trainer's add up to the devices."""
    pools, t = reward_pool_devices(cfg), cfg.trainer
    if not pools:
        return []
    problems = []
    for name, devices in pools.items():
        problems += _pool_problems(POOL_FIELDS[name], _engines(cfg, POOL_FIELDS[name]), devices)
    total, rollout = t.nnodes * t.devices_per_node, t.rollout_devices if t.placement == "separate" else 0
    left = total - rollout - sum(pools.values())
    if left < 1:
        taken = " + ".join(f"{POOL_FIELDS[name]}.engines.devices={n}" for name, n in pools.items())
        problems.append(
            f"the reward pools ({taken}) and trainer.rollout_devices={rollout} leave {left} of the {total} devices "
            "(trainer.nnodes × trainer.devices_per_node) to the trainer: lower them, add nodes, or set "
            "the pools' engines.urls to use servers already running"
        )
    return problems


def _pool_problems(field: str, engines: RewardEnginesConfig, devices: int) -> list[str]:
    tp = engines.tensor_parallel_size
    if engines.engine == "embedded" and tp != 1:
        return [f"{field}.engines.engine=embedded runs one device per replica; set its tensor_parallel_size=1"]
    if tp < 1 or devices < tp or devices % tp:
        return [
            f"{field}.engines.devices={devices} must be a positive multiple of {field}.engines.tensor_parallel_size="
            f"{tp} (replicas = devices ÷ tensor_parallel_size)"
        ]
    return []


def _conflict_problems(cfg: MegarlConfig) -> list[str]:
    """Dynamic sampling with the Megatron RM; SGLang reward engines on a CPU run."""
    problems = []
    rm = cfg.reward_model.discriminative
    if cfg.algorithm.filter_groups.enable and rm.enable and rm.backend == "megatron":
        problems.append(
            f"algorithm.filter_groups.enable with {RM}.backend=megatron: dynamic sampling needs every score before "
            f"training, but the Megatron RM scores a step's trajectories after the rollout, on the trainer's devices; "
            f"set {RM}.backend=server (or disable algorithm.filter_groups)"
        )
    for name in reward_pool_devices(cfg):
        field = POOL_FIELDS[name]
        if _engines(cfg, field).engine == "sglang" and cfg.trainer.device == "cpu":
            problems.append(
                f"{field}.engines.engine=sglang needs GPUs but trainer.device=cpu; use {field}.engines.engine=embedded "
                f"on CPU (or {field}.engines.urls for servers running elsewhere)"
            )
    return problems


def read_hf_json(path: str) -> dict[str, Any] | None:
    """`<path>/config.json` as a dict; None when there is none."""
    config_file = Path(path) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def _checkpoint_problems(cfg: MegarlConfig, field: str, path: str, check_files: bool) -> list[str]:
    """A model directory with a config.json of a family megarl builds; a discriminative one a one-label classifier
    whose Megatron layout fits it and the training devices; engines' TP that divides the heads."""
    hf = read_hf_json(path)
    if hf is None:
        missing = f"{field}.path: {Path(path) / 'config.json'} does not exist; point it at a HF model directory"
        return [missing] if check_files else _layout_without_model(cfg, field)
    try:
        facts = read_model_facts(path)
    except (ConfigError, KeyError, ValueError) as err:
        return [f"{field}.path: {path}/config.json is not a decoder model's config ({err!r})"]
    problems = _classifier_problems(path, hf) if field == RM else []
    try:
        model_spec(load_hf_config(path))
    except ValueError as err:
        problems.append(f"{field}.path: {path} is not a model family megarl builds: {err}")
    tp = _engines(cfg, field).tensor_parallel_size
    if _engines(cfg, field).engine == "sglang" and tp >= 1 and facts.num_heads % tp:
        problems.append(f"{field}.engines.tensor_parallel_size={tp} must divide the model's {facts.num_heads} heads")
    rm, devices = cfg.reward_model.discriminative, training_devices(cfg)
    if field == RM and rm.backend == "megatron" and devices >= 1:
        problems += check_layout(f"{RM}.megatron", rm.megatron, facts, devices)
    return problems


def _layout_without_model(cfg: MegarlConfig, field: str) -> list[str]:
    """The Megatron RM's model parallel size against the training devices, its config.json not at hand."""
    rm, devices = cfg.reward_model.discriminative, training_devices(cfg)
    if field != RM or rm.backend != "megatron" or devices < 1:
        return []
    mp = rm.megatron
    tp, pp, cp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.context_parallel_size
    if min(tp, pp, cp) >= 1 and devices % (tp * pp * cp) == 0:
        return []
    return [f"{RM}.megatron: tp×pp×cp = {tp}×{pp}×{cp} must divide the {devices} training devices ({TRAINING_DEVICES})"]


def _classifier_problems(path: str, hf: dict[str, Any]) -> list[str]:
    """One label of a `*ForSequenceClassification` (transformers: num_labels, else len(id2label), else 2)."""
    architectures = hf.get("architectures") or []
    labels = int(hf["num_labels"]) if "num_labels" in hf else len(hf.get("id2label") or {}) or 2
    problems = []
    if not any(str(name).endswith(CLASSIFIER_SUFFIX) for name in architectures):
        problems.append(
            f"{RM}.path: {path}/config.json names architectures {architectures}, not a *{CLASSIFIER_SUFFIX} "
            f"checkpoint (a score head); give a sequence classifier, or judge with {JUDGE} instead"
        )
    if labels != 1:
        problems.append(
            f"{RM}.path: {path}/config.json has num_labels={labels} (id2label, or transformers' default of 2); a "
            "reward model reads one score: use a classifier with num_labels=1"
        )
    return problems


def _sized_paths(cfg: MegarlConfig) -> dict[str, str]:
    """The reward models and the distillation teacher with a path, by config group."""
    teacher = cfg.algorithm.distillation
    paths = {TEACHER: teacher.teacher.path} if teacher.enable and teacher.teacher.path else {}
    return _model_paths(cfg) | paths


def _on_megatron(cfg: MegarlConfig, field: str) -> MegatronConfig | None:
    """The layout of a frozen model that runs on the training devices, else None."""
    rm, teacher = cfg.reward_model.discriminative, cfg.algorithm.distillation.teacher
    if field == RM and rm.backend == "megatron":
        return rm.megatron
    return teacher.megatron if field == TEACHER and teacher.backend == "megatron" else None


def reward_model_sizes(cfg: MegarlConfig) -> dict[str, RewardModelSize]:
    """The enabled reward models and the teacher whose config.json is readable, by `SHORT_NAMES`."""
    sizes = {}
    for field, path in _sized_paths(cfg).items():
        if read_hf_json(path) is None:
            continue
        counts = count_params(model_spec(load_hf_config(path)))
        mp = _on_megatron(cfg, field)
        params = counts.total - counts.output + counts.hidden_size if field == RM else counts.total
        shard = device_shard(counts, mp, value_head=field == RM) if mp is not None else None
        sizes[SHORT_NAMES[field]] = RewardModelSize(field=field, path=path, params=params, shard=shard)
    return sizes


def frozen_memory(cfg: MegarlConfig, sizes: dict[str, RewardModelSize]) -> list[RoleMemory]:
    """The Megatron RM and teacher on the training devices, as the reference: weights in `model.dtype`, no gradients
    or optimizer state, moved to host while the colocated engines generate when their `offload` is set."""
    offload = {"rm": cfg.reward_model.discriminative.offload, "teacher": cfg.algorithm.distillation.teacher.offload}
    memory = []
    for name, size in sizes.items():
        if size.shard is None:
            continue
        params = size.shard.total * DTYPE_BYTES[cfg.model.dtype]
        offloaded = params if cfg.trainer.placement == "colocated" and offload[name] else 0.0
        memory.append(RoleMemory(name, params, 0.0, 0.0, 0.0, offloaded))
    return memory


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def pool_text(cfg: MegarlConfig, name: str) -> str:
    """What reward pool `name` (of `reward_pool_devices`) runs, for the plan's pool lines."""
    field = POOL_FIELDS[name]
    engines = _engines(cfg, field)
    replicas = engines.devices // max(engines.tensor_parallel_size, 1)
    return f"{replicas} {engines.engine} replica(s) ({field}.engines.devices)"


def model_lines(cfg: MegarlConfig, sizes: dict[str, RewardModelSize]) -> list[str]:
    """One line per reward source and the teacher: its model, parameters and where it runs."""
    lines = []
    for field, path in _sized_paths(cfg).items():
        size = sizes.get(SHORT_NAMES[field])
        params = f"{_billions(size.params)} params" if size else "no config.json here: size unknown"
        lines.append(f"{SHORT_NAMES[field]:<10} {path} ({params}); {_where(cfg, field)}")
    if cfg.reward_model.remote.url is not None:
        lines.append(f"{'remote':<10} {cfg.reward_model.remote.url} (reward_model.remote.url): no devices")
    return lines


def _where(cfg: MegarlConfig, field: str) -> str:
    engines, mp = _engines(cfg, field), _on_megatron(cfg, field)
    if mp is not None:
        tp, pp, cp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.context_parallel_size
        dp = training_devices(cfg) // (tp * pp * cp)
        offloads = (
            cfg.reward_model.discriminative.offload if field == RM else cfg.algorithm.distillation.teacher.offload
        )
        offload = ", offloaded while the engines generate" if offloads else ""
        return f"Megatron on the training devices, TP={tp} PP={pp} DP={dp}{offload}"
    if engines.urls:
        return f"{len(engines.urls)} running server(s) ({field}.engines.urls)"
    replicas = engines.devices // max(engines.tensor_parallel_size, 1)
    pool = next(name for name, group in POOL_FIELDS.items() if group == field)
    return f"{replicas} {engines.engine} replica(s) of TP={engines.tensor_parallel_size} on the {pool} pool"


def frozen_held(sizes: dict[str, RewardModelSize], name: str) -> str:
    """The memory table's note for the Megatron RM or teacher (`name`)."""
    shard = sizes[name].shard
    assert shard is not None
    model = "the reward model" if name == "rm" else "the teacher"
    return f"{_billions(shard.total)} params of {model}, weights only"
