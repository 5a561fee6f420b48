"""The critic: values of every response token and clipped value-loss updates."""

from megarl.batch import Batch
from megarl.config.root import MegarlConfig
from megarl.megatron.engine import MicroBatching
from megarl.megatron.losses import ValueLoss
from megarl.megatron.offload import Offloader
from megarl.plan.facts import batch_sizes
from megarl.workers.base import RankWorker, SkipGuard, build_role, engine_inputs, run_updates


class CriticWorker(RankWorker):
    def setup(self, cfg: MegarlConfig, total_steps: int) -> None:
        """Build the value model: critic.model_path, else model.path (or a seeded random init), with a zero head."""
        self.cfg = cfg
        sizes = batch_sizes(cfg, "critic")
        self.num_mini_batches = sizes.mini_batches_per_step
        weights = cfg.critic.model_path or (None if cfg.model.random_init else cfg.model.path)
        self.role = build_role(
            cfg.model,
            cfg.critic.megatron,
            weights_path=weights,
            seed=cfg.trainer.seed + 1,
            value_head=True,
            optim=cfg.critic.optim,
            total_steps=total_steps * sizes.mini_batches_per_step * cfg.critic.ppo_epochs,
        )
        self.skip_guard = SkipGuard("critic", cfg.trainer.max_skipped_steps)
        if cfg.critic.offload and cfg.trainer.placement == "colocated":
            assert self.role.trainable is not None
            self.offloader = Offloader(self.role.trainable)

    def _batching(self) -> MicroBatching:
        c = self.cfg.critic
        return MicroBatching(c.ppo_micro_batch_size_per_device, c.use_dynamic_bsz, c.ppo_max_token_len_per_device)

    def compute_values(self, batch: Batch) -> Batch:
        """`values` `[b, r]` of this DP shard's trajectories."""
        out = self._role().engine.forward(engine_inputs(batch), self._batching())
        return Batch.from_dict({"values": out["values"]})

    def update(self, shard: Batch, step: int) -> dict[str, float]:
        """Value-loss epochs over this DP shard; returns `critic/…` metrics."""
        c = self.cfg.critic
        metrics = run_updates(
            self._role().engine,
            shard,
            num_mini_batches=self.num_mini_batches,
            epochs=c.ppo_epochs,
            shuffle=self.cfg.actor.shuffle,
            seed=self.cfg.trainer.seed + 1000 * step + 500,
            micro=self._batching(),
            loss_fn=ValueLoss(c.cliprange_value, self.cfg.algorithm.loss_agg_mode),
            columns=("values", "returns"),
            temperature=1.0,
            norm_length=float(self.cfg.data.max_response_length),
            guard=self.skip_guard,
            step=step,
        )
        return {f"critic/{key}": value for key, value in metrics.items()}
