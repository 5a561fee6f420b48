"""The actor: recomputes log-probs, takes PPO steps, and pushes its weights into the rollout engines."""

from typing import Any

from megarl.batch import ROUTING_COLUMN, Batch
from megarl.engines.client.auth import EngineKeys
from megarl.megatron.losses import PolicyLoss, SFTLoss
from megarl.megatron.offload import resident_bytes
from megarl.workers.base import DTYPES, SkipGuard, build_role_from, engine_inputs, update_step
from megarl.workers.reference import AdaptersOff, ReferenceHost, ReferencePolicy
from megarl.workers.settings import ActorSettings, ReferenceSettings

ACTOR_COLUMNS = ("old_log_probs", "advantages", "rollout_log_probs", "ref_log_probs", "rollout_is_batch_mean")


class ActorWorker(ReferenceHost):
    def setup(
        self,
        settings: ActorSettings,
        engine_urls: list[str],
        engine_sites: list[tuple[str, ...]] | None = None,
        rank_sites: tuple[str, ...] = (),
        engine_keys: EngineKeys | None = None,
    ) -> None:
        """Build the policy; with `engine_urls`, also the weight syncer (colocated: with its sequencing), whose
        engine calls carry `engine_keys`. `engine_sites` (per replica, per engine rank) and `rank_sites` (per
        actor rank) say where memory lives (`engines.replicas.placement.memory_site`), so that handles go only
        where they open."""
        self.settings = settings
        self.role = build_role_from(settings.model)
        if settings.router_replay != "disabled":
            self.role.engine.enable_routing_replay()
        self.skip_guard = SkipGuard("actor", settings.update.max_skipped_steps)
        self.syncer: Any = None
        self.sequence: Any = None
        if engine_urls:
            self._build_syncer(engine_urls, engine_sites, rank_sites, engine_keys)

    def host_reference(self, settings: ReferenceSettings) -> None:
        """The reference policy in this process, on the actor's process groups (`ref.megatron` unset: the actor's
        layout), so it needs no processes, process groups or device context of its own. With `ref.offload` it
        leaves the device and comes back (`release`, `restore`) as a reference rank would. A LoRA actor's
        reference is itself with its adapters off."""
        role = self._role()
        self.reference = AdaptersOff(settings, role) if role.model.adapters else ReferencePolicy(settings, role.groups)
        self.offloader = self.reference.offloader

    def _build_syncer(
        self,
        urls: list[str],
        sites: list[tuple[str, ...]] | None,
        rank_sites: tuple[str, ...],
        keys: EngineKeys | None,
    ) -> None:
        from megarl.sync.build import build_syncer, engine_targets
        from megarl.sync.sequence import ColocatedSequence

        s, role, lora = self.settings.sync, self._role(), self.settings.model.lora
        targets = engine_targets(s.rollout, urls, sites)
        dtype = DTYPES[s.engine_dtype]
        self.syncer = build_syncer(
            role.model,
            role.groups,
            s.sync,
            s.placement,
            targets,
            dtype,
            keys,
            rank_sites=rank_sites,
            lora=lora,
            ranks_per_engine=targets[0].ranks if targets else 1,
        )
        if s.placement == "colocated":
            assert role.trainable is not None
            self.sequence = ColocatedSequence(self.syncer, role.trainable, s.rollout.enable_weights_cpu_backup)

    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs` and `entropy` `[b, r]` of this DP shard's trajectories, and `sum_pi_squared` when the
        advantage estimator reads it (the optimal token baseline).

        Routing replay: R3 replays the engine's `routed_experts` and returns `routing_mismatch`/`routing_tokens`
        `[b]` (token×layer pairs whose own top-k differed, and those with a record); R2 returns the routing this
        pass chose as `routed_experts` `[b, s, moe_layers·k]` (the engines' column layout), which the update replays."""
        s = self.settings
        extras = ("entropy", "sum_pi_squared") if s.needs_sum_pi_squared else ("entropy",)
        mode = s.router_replay
        inputs = engine_inputs(batch, *((ROUTING_COLUMN,) if mode == "R3" else ()))
        if mode == "R3" and ROUTING_COLUMN not in inputs:
            raise ValueError("actor.router_replay=R3 needs the engines' routed_experts; this batch has none")
        out = self._role().engine.forward(
            inputs, s.log_prob_micro, s.temperature, extras=extras, record_routing=mode == "R2"
        )
        return Batch.from_dict({"old_log_probs": out.pop("log_probs"), **out})

    def update(self, shard: Batch, step: int) -> dict[str, float]:
        """PPO epochs over this DP shard; returns `actor/…` metrics (already reduced over DP)."""
        s = self.settings
        metrics = update_step(
            self._role().engine,
            shard,
            s.update,
            loss_fn=PolicyLoss(s.algorithm),
            columns=ACTOR_COLUMNS + ((ROUTING_COLUMN,) if s.router_replay != "disabled" else ()),
            temperature=s.temperature,
            guard=self.skip_guard,
            step=step,
        )
        return {f"actor/{key}": value for key, value in metrics.items()}

    def sft_update(self, shard: Batch, step: int) -> dict[str, float]:
        """Supervised steps on this DP shard of conversations (`SFTLoss` on the assistant tokens, temperature 1);
        returns `actor/…` metrics, `actor/loss` the mean cross-entropy per assistant token."""
        s = self.settings
        metrics = update_step(
            self._role().engine,
            shard,
            s.update,
            loss_fn=SFTLoss(),
            columns=(),
            temperature=1.0,
            guard=self.skip_guard,
            step=step,
        )
        return {f"actor/{key}": value for key, value in metrics.items()}

    def to_rollout(self, weight_version: str, full: bool = False) -> dict[str, float]:
        """Push the weights into every engine (colocated: free the trainer's memory and wake the engines); `full`:
        every tensor, also with delta sync (an engine was restarted and holds the checkpoint's weights)."""
        if full:
            self.syncer.rejoin()
        if self.sequence is not None:
            metrics = self.sequence.to_rollout(weight_version, full).as_dict("sync/")
            return metrics | self.sequence.timings | self.sequence.memory
        return self.syncer.sync(weight_version, full).as_dict("sync/")

    def vacate(self) -> int:
        """Colocated, before an engine restarts: parameters, gradients and optimizer state off the device and its
        cache emptied (`to_rollout` brings the parameters back); the bytes of them this rank still holds."""
        trainable = self._role().trainable
        assert self.sequence is not None and trainable is not None, "only a colocated actor leaves to engines"
        self.sequence.vacate()
        return resident_bytes(trainable)

    def to_training(self) -> None:
        """Colocated: put the engines to sleep and reload the trainer's memory (separate pools: nothing)."""
        if self.sequence is not None:
            self.sequence.to_training()
