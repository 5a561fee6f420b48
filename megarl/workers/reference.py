"""The frozen reference policy: log-probs for the KL term, nothing else."""

from megarl.batch import Batch
from megarl.config.root import MegarlConfig
from megarl.megatron.engine import MicroBatching
from megarl.megatron.offload import Offloader
from megarl.workers.base import RankWorker, build_role, engine_inputs


class ReferenceWorker(RankWorker):
    def setup(self, cfg: MegarlConfig) -> None:
        """The initial policy (model.path, or the actor's seeded random init) on ref.megatron or the actor's layout."""
        self.cfg = cfg
        self.role = build_role(
            cfg.model,
            cfg.ref.megatron or cfg.actor.megatron,
            weights_path=None if cfg.model.random_init else cfg.model.path,
            seed=cfg.trainer.seed,
        )
        if cfg.ref.offload and cfg.trainer.placement == "colocated":
            self.offloader = Offloader(self.role.model, grads=False, optimizer=False)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_probs` `[b, r]` of this DP shard's trajectories."""
        a = self.cfg.actor
        size = self.cfg.ref.log_prob_micro_batch_size_per_device or a.log_prob_micro_batch_size_per_device
        micro = MicroBatching(
            size or a.ppo_micro_batch_size_per_device, a.use_dynamic_bsz, a.ppo_max_token_len_per_device
        )
        out = self._role().engine.forward(engine_inputs(batch), micro, self.cfg.rollout.temperature)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})
