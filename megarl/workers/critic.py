"""The critic: values of every response token and clipped value-loss updates."""

from megarl.batch import Batch
from megarl.megatron.losses import ValueLoss
from megarl.megatron.offload import Offloader
from megarl.workers.base import RankWorker, SkipGuard, build_role_from, engine_inputs, update_step
from megarl.workers.settings import CriticSettings


class CriticWorker(RankWorker):
    def setup(self, settings: CriticSettings) -> None:
        """Build the value model: critic.model_path, else model.path (or a seeded random init), with a zero head."""
        self.settings = settings
        self.role = build_role_from(settings.model)
        self.skip_guard = SkipGuard("critic", settings.update.max_skipped_steps)
        if settings.offload:
            assert self.role.trainable is not None
            self.offloader = Offloader(self.role.trainable)

    def compute_values(self, batch: Batch) -> Batch:
        """`values` `[b, r]` of this DP shard's trajectories."""
        out = self._role().engine.forward(engine_inputs(batch), self.settings.update.micro)
        return Batch.from_dict({"values": out["values"]})

    def update(self, shard: Batch, step: int) -> dict[str, float]:
        """Value-loss epochs over this DP shard; returns `critic/…` metrics."""
        s = self.settings
        metrics = update_step(
            self._role().engine,
            shard,
            s.update,
            loss_fn=ValueLoss(s.cliprange_value, s.loss_agg_mode),
            columns=("values", "returns"),
            temperature=1.0,
            guard=self.skip_guard,
            step=step,
        )
        return {f"critic/{key}": value for key, value in metrics.items()}
