"""What asynchronous training can overlap: one step's rollout and training time, from rooflines.

- Training is compute-bound: 2·N FLOPs per token for a forward pass and 6·N for forward + backward
  (N = active parameters). A step runs the actor's old-log-prob pass, the reference's when a KL term
  reads it, the critic's value pass and update when it trains, and `ppo_epochs` actor updates, over
  every trajectory's prompt + response budget, on the training devices at `plan.train_tflops` each.
- Decoding is weight-bandwidth-bound: every decode step of a replica reads its weights once, whatever
  the number of sequences it batches, at `plan.hbm_gbps` per device; a step's rollout is
  `max_response_length` decode steps (prefill and KV-cache reads are left out: a lower bound).

In sequence a step costs rollout + training + sync; overlapped (separate pools, asynchronous drivers)
about max(rollout, training) + sync.
"""

from dataclasses import dataclass

from megarl.config.root import MegarlConfig
from megarl.plan.facts import critic_enabled, reference_needed, training_devices
from megarl.plan.memory import GB, engine_dtype_bytes
from megarl.plan.params import ParamCounts


@dataclass(frozen=True, slots=True)
class StepEstimate:
    rollout_s: float
    train_s: float
    sync_s: float

    @property
    def sequential_s(self) -> float:
        return self.rollout_s + self.train_s + self.sync_s

    @property
    def overlapped_s(self) -> float:
        return max(self.rollout_s, self.train_s) + self.sync_s


def step_estimate(cfg: MegarlConfig, counts: ParamCounts, sync_s: float, replica_devices: int) -> StepEstimate:
    """Rooflines of one step (module docstring); `replica_devices` = devices per rollout replica."""
    return StepEstimate(_rollout_seconds(cfg, counts, replica_devices), _train_seconds(cfg, counts), sync_s)


def _train_seconds(cfg: MegarlConfig, counts: ParamCounts) -> float:
    d = cfg.data
    tokens = d.train_batch_size * cfg.rollout.n * (d.max_prompt_length + d.max_response_length)
    passes = 2 + 6 * cfg.actor.ppo_epochs  # old log-probs, then the updates
    passes += 2 if reference_needed(cfg) else 0
    passes += 2 + 6 * cfg.critic.ppo_epochs if critic_enabled(cfg) else 0
    return passes * counts.active * tokens / (training_devices(cfg) * cfg.plan.train_tflops * 1e12)


def _rollout_seconds(cfg: MegarlConfig, counts: ParamCounts, replica_devices: int) -> float:
    step_s = counts.total * engine_dtype_bytes(cfg) / (replica_devices * cfg.plan.hbm_gbps * GB)
    return cfg.data.max_response_length * step_s  # the replicas decode their shares of the batch side by side


def overlap_line(cfg: MegarlConfig, estimate: StepEstimate) -> str:
    """The `async` line of megarl-plan."""
    e = estimate
    return (
        f"async      {cfg.trainer.driver}: per step ~{e.rollout_s:.3g} s rollout, ~{e.train_s:.3g} s training, "
        f"~{e.sync_s:.3g} s sync (rooflines) → ~{e.overlapped_s:.3g} s overlapped vs ~{e.sequential_s:.3g} s in "
        f"sequence (≤ {e.sequential_s / e.overlapped_s:.2f}×)"
    )
