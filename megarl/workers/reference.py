"""The frozen reference policy: log-probs for the KL term, nothing else.

It runs in the actor's processes when it shares the actor's layout (`ref.megatron` unset, the default:
`ActorWorker.host_reference`), else in processes of its own (`ReferenceWorker`); either rank serves
`ReferenceHost.compute_ref_log_prob`. A LoRA actor's reference is its own model with the adapters off
(`AdaptersOff`). Under R3 it replays the rollout engines' routing (`ReferenceSettings.replays_routing`).
"""

import torch

from megarl.batch import ROUTING_COLUMN, Batch
from megarl.lora.model import adapters_disabled
from megarl.megatron.offload import Offloader
from megarl.megatron.parallel import RoleGroups
from megarl.workers.base import RankWorker, RoleModel, build_role_from, engine_inputs
from megarl.workers.settings import ReferenceSettings


class ReferencePolicy:
    """One rank's reference model (model.path, or the actor's seeded random init) and, with `ref.offload`, its
    offloader."""

    def __init__(self, settings: ReferenceSettings, groups: RoleGroups | None = None) -> None:
        """`groups`: the process groups of the actor this rank also runs (None: the reference's own, built)."""
        self.settings = settings
        with torch.random.fork_rng(devices=[]):  # a hosting actor's RNG stream stays its own
            self.role: RoleModel = build_role_from(settings.model, groups)
        self.offloader = Offloader(self.role.model, grads=False, optimizer=False) if settings.offload else None
        if settings.replays_routing:
            self.role.engine.enable_routing_replay()

    def log_probs(self, batch: Batch) -> Batch:
        s = self.settings
        out = self.role.engine.forward(reference_inputs(batch, s), s.micro, s.temperature)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})


class AdaptersOff:
    """The reference of a LoRA actor: the actor's own model with its adapters off (the base it started from), on
    the actor's engine; no model, memory or offload of its own."""

    def __init__(self, settings: ReferenceSettings, role: RoleModel) -> None:
        self.settings = settings
        self.role = role
        self.offloader: Offloader | None = None

    def log_probs(self, batch: Batch) -> Batch:
        s = self.settings
        with adapters_disabled(self.role.model):  # the actor's engine, whose replay the actor enabled
            out = self.role.engine.forward(reference_inputs(batch, s), s.micro, s.temperature)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})


def reference_inputs(batch: Batch, settings: ReferenceSettings) -> dict[str, torch.Tensor]:
    """The engine's inputs of a reference pass: with `replays_routing`, the routing to replay too."""
    if not settings.replays_routing:
        return engine_inputs(batch)
    if ROUTING_COLUMN not in batch:
        raise ValueError("the reference replays the engines' routed_experts (R3); this batch has none")
    return engine_inputs(batch, ROUTING_COLUMN)


class ReferenceHost(RankWorker):
    """A rank that serves reference log-probs: a reference rank, or an actor rank hosting the reference."""

    reference: ReferencePolicy | AdaptersOff | None = None

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_probs` `[b, r]` of this DP shard's trajectories."""
        assert self.reference is not None, "no reference policy was set up on this rank"
        return self.reference.log_probs(batch)


class ReferenceWorker(ReferenceHost):
    """A reference rank of its own (`ref.megatron` set: a layout other than the actor's)."""

    def setup(self, settings: ReferenceSettings) -> None:
        """The reference policy on ref.megatron."""
        self.reference = ReferencePolicy(settings)
        self.role, self.offloader = self.reference.role, self.reference.offloader
