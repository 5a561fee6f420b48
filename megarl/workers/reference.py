"""The frozen reference policy: log-probs for the KL term, nothing else."""

from megarl.batch import Batch
from megarl.megatron.offload import Offloader
from megarl.workers.base import RankWorker, build_role_from, engine_inputs
from megarl.workers.settings import ReferenceSettings


class ReferenceWorker(RankWorker):
    def setup(self, settings: ReferenceSettings) -> None:
        """The initial policy (model.path, or the actor's seeded random init) on ref.megatron or the actor's layout."""
        self.settings = settings
        self.role = build_role_from(settings.model)
        if settings.offload:
            self.offloader = Offloader(self.role.model, grads=False, optimizer=False)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_probs` `[b, r]` of this DP shard's trajectories."""
        s = self.settings
        out = self._role().engine.forward(engine_inputs(batch), s.micro, s.temperature)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})
