"""The on-policy distillation teacher as a Megatron role (`algorithm.distillation.teacher`, backend=megatron).

A frozen causal LM built from its own HF checkpoint (any family megarl builds; it may be larger than the student) on
its own layout (`teacher.megatron`: TP/PP/EP, DP the rest of the trainer's devices), forward only: the log-prob of
every sampled response token, as the reference computes its own (packed micro-batches, the rollout's temperature).
With `offload` it leaves the device through `RankWorker.release` and comes back through `RankWorker.restore` around
its scoring, as the reward model does.
"""

from megarl.batch import Batch
from megarl.megatron.offload import Offloader
from megarl.workers.base import RankWorker, build_role_from, engine_inputs
from megarl.workers.settings import TeacherSettings


class TeacherWorker(RankWorker):
    def setup(self, settings: TeacherSettings) -> None:
        """Build the teacher from `teacher.path`."""
        self.settings = settings
        self.role = build_role_from(settings.model)
        if settings.offload:
            self.offloader = Offloader(self.role.model, grads=False, optimizer=False)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """`teacher_log_probs` `[b, r]` of this DP shard's trajectories (0 where the response has no token)."""
        s = self.settings
        out = self._role().engine.forward(engine_inputs(batch), s.micro, s.temperature)
        return Batch.from_dict({"teacher_log_probs": out["log_probs"]})
