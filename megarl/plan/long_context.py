"""The smallest context-parallel size (CP) at which a training role fits its longest trajectory.

The longest trajectory (`data.max_prompt_length + data.max_response_length` tokens) in a micro-batch of its
own, the least a micro-batch can hold, must fit on a device beside what stays there while the role trains: every
role's parameters, gradients and optimizer state (the role's own at that CP: CP leaves fewer data-parallel ranks
to shard its optimizer state), the reserve, and a colocated engine that does not release its memory. Each CP rank
keeps 1/CP of the trajectory's activations (`megarl.plan.memory.activation_bytes`; the sequence rounded up to
2·CP, × TP under sequence parallelism). Candidates are the sizes that divide the training devices ÷ (TP × PP),
the role's other sizes unchanged; megarl runs CP > 1 packed only, and not with routing replay.
"""

from dataclasses import dataclass, replace

from megarl.config.root import MegarlConfig
from megarl.config.training import MegatronConfig
from megarl.models.spec import ModelSpec
from megarl.plan.facts import training_devices
from megarl.plan.memory import EngineMemory, RoleMemory, device_peaks, role_memory, round_up, token_multiple
from megarl.plan.params import ParamCounts


@dataclass(frozen=True, slots=True)
class ContextNeed:
    """What one trajectory of `tokens` tokens needs of a training role's CP."""

    role: str
    tokens: int
    cp: int | None
    """The smallest CP that fits; None when no candidate does."""
    at: int
    """The CP the numbers below are for: `cp`, or the largest candidate when none fits."""
    activations: float
    """Activations per device at CP=`at`."""
    peak: float
    """Peak bytes per device while training, at CP=`at`."""


def context_need(
    cfg: MegarlConfig, spec: ModelSpec, counts: ParamCounts, memory: list[RoleMemory], engine: EngineMemory, name: str
) -> ContextNeed:
    """The smallest CP at which role `name` (actor or critic) fits its longest trajectory, beside the other roles'
    `memory` and the `engine` as the plan has them (module docstring)."""
    mp = cfg.actor.megatron if name == "actor" else cfg.critic.megatron
    group = training_devices(cfg) // (mp.tensor_model_parallel_size * mp.pipeline_model_parallel_size)
    limit = cfg.plan.device_memory_gb * 1e9
    need = None
    for cp in [c for c in range(1, group + 1) if group % c == 0]:
        need = _at(cfg, spec, counts, memory, engine, name, replace(mp, context_parallel_size=cp))
        if need.peak <= limit:
            return need
    assert need is not None  # CP = 1 is always a candidate
    return replace(need, cp=None)


def _at(
    cfg: MegarlConfig,
    spec: ModelSpec,
    counts: ParamCounts,
    memory: list[RoleMemory],
    engine: EngineMemory,
    name: str,
    mp: MegatronConfig,
) -> ContextNeed:
    """The training peak with role `name` laid out as `mp` and one longest trajectory per micro-batch."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    mine = role_memory(name, cfg, spec, counts, mp, training_devices(cfg), tokens=round_up(longest, token_multiple(mp)))
    others = [replace(m, activations=0.0) for m in memory if m.name != name]  # their micro-batches are done
    peaks = device_peaks(cfg, [mine, *others], engine)
    peak = peaks["shared" if "shared" in peaks else "training"].training
    cp = mp.context_parallel_size
    return ContextNeed(role=name, tokens=longest, cp=cp, at=cp, activations=mine.activations, peak=peak)
