"""The PPO/GRPO driver: `Trainer.fit()` reads top to bottom, one training step per loop iteration.

Each step: prompts → uid, n samples each → rollout (agent loops on the engines) → engines sleep →
scores (in a driver thread, overlapping) → old log-probs (actor) → reference log-probs → values
(critic) → advantages on the driver → critic update → actor update (after critic warm-up) →
checkpoint when due → weight sync (engines wake with the new weights) → validation when due →
metrics. The driver holds only `Batch`es; tensors on the workers stay there.

Built by `megarl.trainer.build.build_trainer`; `megarl.trainer.modes` reuses its pieces for rollout-/train-only.
"""

import dataclasses
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from megarl import algo
from megarl.agents.manager import RolloutManager
from megarl.batch import Batch
from megarl.config.root import MegarlConfig
from megarl.data import StatefulDataLoader
from megarl.engines.client.fleet import Fleet
from megarl.rewards import RewardResult
from megarl.rewards.score import Scored, score_batch, score_each
from megarl.trainer import steps
from megarl.trainer.checkpoint import CheckpointManager, load_trainer_state
from megarl.trainer.engine_recovery import EngineRecovery
from megarl.trainer.eval_metrics import validation_metrics
from megarl.trainer.metrics import check_log_prob_gap, data_metrics, entropy_metric, log_prob_gap, throughput, timer
from megarl.trainer.plot import DEFAULT_PLOT_KEYS, plot_metrics
from megarl.trainer.rollout_dump import decode_prompts, dump_rollouts
from megarl.trainer.tracking import ProgressBar, Tracker, read_metrics
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.reference import ReferenceWorker

logger = logging.getLogger("megarl")
W = TypeVar("W", bound=RankWorker)


@dataclass(kw_only=True, slots=True)
class Roles:
    actor: WorkerGroup[ActorWorker]
    ref: WorkerGroup[ReferenceWorker] | None = None
    critic: WorkerGroup[CriticWorker] | None = None


class Trainer:
    def __init__(
        self,
        cfg: MegarlConfig,
        *,
        roles: Roles | None,
        rollout: RolloutManager | None,
        engines: Fleet | None = None,
        tokenizer: Any,
        loader: StatefulDataLoader[Batch] | None,
        val_loader: StatefulDataLoader[Batch] | None,
        total_steps: int,
        num_devices: int,
    ) -> None:
        self.cfg = cfg
        self.roles = roles
        self.rollout = rollout
        self.engines = engines
        """The driver's clients of the engines (pauses across an asynchronous weight push); None without engines."""
        self.tokenizer = tokenizer
        self.loader = loader
        self.val_loader = val_loader
        self.total_steps = total_steps
        self.num_devices = num_devices
        self.run_dir = Path(cfg.trainer.run_dir)
        self.kl_ctrl = algo.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", cfg.trainer.max_checkpoints_to_keep)
        t = cfg.trainer
        self.tracker = Tracker(
            t.logger, self.run_dir, t.project_name, t.experiment_name, dataclasses.asdict(cfg), resume=True
        )
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="megarl-reward")
        self._prompts: Iterator[Batch] | None = None
        self._dispatch: dict[str, float] = {}
        self.resumed_state: dict[str, Any] = {}
        """The trainer state of the checkpoint `resume` loaded (empty when starting fresh)."""
        self.recovery = EngineRecovery()
        """Restarts engines that died or hung between the phases of a step (`running_job` gives it the engines)."""

    def fit(self) -> None:
        """Train for `total_steps` steps from the latest checkpoint (or from scratch)."""
        cfg = self.cfg.trainer
        step = self.resume()
        self.to_rollout(step)  # colocated engines were released at start-up (trainer/build.py)
        if cfg.val_before_train and step == 0:
            self.tracker.log(self.validate(step), step)
        bar = ProgressBar(self.total_steps, step, disable=not cfg.progress_bar)
        while step < self.total_steps:
            step += 1
            last = step == self.total_steps
            timings: dict[str, float] = {}
            metrics: dict[str, float] = {}
            with timer("step", timings):
                with timer("gen", timings):
                    batch, scores, gen_metrics = self.collect(step)
                with timer("engine_sleep", timings):
                    metrics |= self.to_training()
                metrics |= gen_metrics | self.train_on(batch, scores, step, timings)
                if self.due(cfg.save_freq, step, last):
                    with timer("save_checkpoint", timings):
                        self.save_checkpoint(step, metrics | timings)
                with timer("sync", timings):
                    metrics |= self.to_rollout(step)
                if self.validation_due(step, last):
                    with timer("testing", timings):
                        metrics |= self.validate(step)
            metrics |= self.step_metrics(batch, timings)
            self.tracker.log(metrics, step)
            bar.update(step, metrics)
        bar.close()
        self.finish()

    # ---- pieces of a step ----

    def _offloading(self) -> list[WorkerGroup[RankWorker]]:
        roles = self._roles()
        return [group for group in (roles.ref, roles.critic) if group is not None]

    def to_rollout(self, step: int) -> dict[str, float]:
        """Reference and critic leave the device if they offload; engines that exited while asleep are restarted
        (colocated: once the actor left the device too); then the actor syncs into the engines (in full after a
        restart, which is then taken back)."""
        metrics: dict[str, float] = {}
        for group in self._offloading():
            released = group.broadcast(RankWorker.release)[0]  # rank 0's; empty without offload
            # offload/bytes → offload/ref_bytes, handover/reserved_before_bytes → handover/ref_reserved_before_bytes
            metrics |= {key.replace("/", f"/{group.name}_", 1): value for key, value in released.items()}
        full = self.recovery.before_rollout(vacate=lambda: max(self._roles().actor.broadcast(ActorWorker.vacate)))
        metrics |= self._roles().actor.broadcast(ActorWorker.to_rollout, f"v{step}", full)[0]
        return metrics | self.recovery.after_sync()

    def to_training(self) -> dict[str, float]:
        """Engines that died or hung in the rollout are restarted; engines asleep and the actor back on the device,
        then reference and critic."""
        metrics = self.recovery.before_training()
        self._roles().actor.broadcast(ActorWorker.to_training)
        for group in self._offloading():
            group.broadcast(RankWorker.restore)
        return metrics

    def collect(self, step: int) -> tuple[Batch, "Future[Scored]", dict[str, float]]:
        """The step's trajectories (DAPO dynamic sampling: only prompts whose samples differ) and their
        scores, still being computed when reward.overlap and no filtering needs them now."""
        cfg, rollout = self.cfg, self._rollout()
        kept: list[Batch] = []
        num_kept = num_seen = rounds = 0
        metrics: dict[str, float] = {}
        while True:
            rounds += 1
            prompts = self.next_prompts()
            samples = steps.samples_of(prompts, cfg.rollout.n, f"{step}.{rounds}")
            out, metrics = rollout.rollout(samples, seed=self.round_seed(step, rounds))
            batch = samples.union(out)
            if "baseline_scores" in algo.estimator_traits(cfg.algorithm.adv_estimator).needs:
                batch.set("baseline_scores", self.greedy_baseline(prompts, step))
            scores = self.scorer.submit(score_batch, batch, cfg.reward)
            if not cfg.algorithm.filter_groups.enable:
                if not cfg.reward.overlap:
                    scores.result()
                return batch, scores, metrics
            scores.result().record(batch)
            batch, kept_prompts, seen = steps.keep_varied_groups(batch)
            kept.append(batch)
            num_kept, num_seen = num_kept + kept_prompts, num_seen + seen
            limit = cfg.algorithm.filter_groups.max_num_gen_batches
            if num_kept >= cfg.data.train_batch_size:
                break
            if limit and rounds >= limit:
                raise RuntimeError(
                    f"dynamic sampling kept {num_kept} of {cfg.data.train_batch_size} prompts after {rounds} "
                    "generation rounds (algorithm.filter_groups.max_num_gen_batches); raise it or set it to 0"
                )
        full = Batch.concat(kept)[: cfg.data.train_batch_size * cfg.rollout.n]
        done: Future[Scored] = Future()
        done.set_result(Scored.of(full))
        metrics |= {"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_prompt_ratio": num_kept / num_seen}
        return full, done, metrics

    def round_seed(self, step: int, rounds: int) -> int:
        """The rollout seed of generation round `rounds` of step `step` (row i samples with it + 1000·i)."""
        return self.cfg.trainer.seed + 1_000_003 * step + 7919 * rounds

    def next_prompts(self) -> Batch:
        """The next batch of training prompts (epoch after epoch)."""
        return next(self._prompt_stream())

    def train_on(
        self,
        batch: Batch,
        scores: "Future[Scored]",
        step: int,
        timings: dict[str, float],
    ) -> dict[str, float]:
        """Everything after rollout up to the updates; adds the training columns to `batch`."""
        cfg, roles = self.cfg, self._roles()
        metrics: dict[str, float] = {}
        self._old_log_probs(batch, timings)
        if roles.ref is not None:
            with timer("ref", timings):
                self._union(batch, self._forward(roles.ref, ReferenceWorker.compute_ref_log_prob, batch))
        if roles.critic is not None:
            with timer("values", timings):
                self._union(batch, self._forward(roles.critic, CriticWorker.compute_values, batch))
        with timer("reward", timings):
            scored = scores.result()
        with timer("adv", timings):
            scored.record(batch)
            batch.set("scores", steps.shaped_scores(batch, scored.scores, cfg.algorithm, cfg.data.max_response_length))
            metrics |= scored.metrics | steps.compute_advantage(batch, cfg.algorithm, self.kl_ctrl)
        if roles.critic is not None:
            with timer("update_critic", timings):
                metrics |= self._update(roles.critic, CriticWorker.update, batch, step)
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor", timings):
                metrics |= self._update(roles.actor, ActorWorker.update, batch, step)
        if cfg.trainer.dump_rollouts:
            self.dump(batch, step)
        return metrics

    def _old_log_probs(self, batch: Batch, timings: dict[str, float]) -> None:
        """`old_log_probs` and `entropy` (and `sum_pi_squared` when the estimator reads it) from the actor. A loss
        in `algo.SKIPS_OLD_LOG_PROBS` (bypass) never reads π_old: it gets the rollout's log-probs instead, and
        the actor's pass runs only when the estimator needs Σπ²."""
        skip = self.cfg.algorithm.policy_loss in algo.SKIPS_OLD_LOG_PROBS
        if skip:
            batch.set("old_log_probs", batch["rollout_log_probs"])
        if not skip or "sum_pi_squared" in algo.estimator_traits(self.cfg.algorithm.adv_estimator).needs:
            with timer("old_log_prob", timings):
                self._union(batch, self._forward(self._roles().actor, ActorWorker.compute_log_prob, batch))

    def greedy_baseline(self, prompts: Batch, step: int) -> torch.Tensor:
        """ReMax: each prompt's greedy response scored, repeated for its n samples."""
        samples = steps.samples_of(prompts, 1, f"{step}.greedy")
        out, _ = self._rollout().rollout(samples, validate=True)
        scored = score_batch(samples.union(out), self.cfg.reward)
        return scored.scores.repeat_interleave(self.cfg.rollout.n)

    def validate(self, step: int) -> dict[str, float]:
        """`val/…` metrics: mean score overall, response length, and per data source the mean score and the
        n-sample metrics (mean@n, pass@k, best@k, worst@k, maj@k: `trainer/eval_metrics.py`)."""
        assert self.val_loader is not None
        sources: list[str] = []
        uids: list[str] = []
        results: list[RewardResult] = []
        lengths: list[float] = []
        for i, prompts in enumerate(self.val_loader):
            samples = steps.samples_of(prompts, self.cfg.rollout.val.n, f"val{step}.{i}")
            out, _ = self._rollout().rollout(samples, validate=True, seed=self.cfg.trainer.seed)
            batch = samples.union(out)
            results += score_each(batch, self.cfg.reward)
            sources += [str(source) for source in batch["data_source"]]
            uids += [str(uid) for uid in batch["uid"]]
            lengths += batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(dim=1).float().tolist()
        scores, answers = [r.score for r in results], [r.answer for r in results]
        threshold, seed = self.cfg.trainer.val_pass_threshold, self.cfg.trainer.seed
        metrics = {
            f"val/{k}": v for k, v in validation_metrics(sources, uids, scores, answers, threshold, seed).items()
        }
        metrics["val/response_length/mean"] = float(np.mean(lengths))
        return metrics

    def step_metrics(self, batch: Batch, timings: dict[str, float]) -> dict[str, float]:
        """Data, entropy, rollout-vs-trainer gap, throughput and timing; warns on a large gap, stops on a larger one."""
        tensors = {key: batch[key] for key in batch.tensor_keys}
        metrics = data_metrics(tensors, self.cfg.data.max_response_length) | timings
        if "entropy" in batch:  # the actor recomputed the log-probs (bypass skips it)
            metrics |= entropy_metric(batch["entropy"], batch["response_mask"])
            metrics |= log_prob_gap(batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
        metrics |= throughput(batch["attention_mask"], timings["timing/step"], self.num_devices)
        metrics["timing/dispatch"] = self._take_dispatch_seconds()
        check_log_prob_gap(metrics, self.cfg.trainer)
        return metrics

    # ---- checkpoints and the end ----

    def save_checkpoint(self, step: int, metrics: dict[str, float], extra: dict[str, Any] | None = None) -> None:
        """Every trainable role, the loader position, the KL controller, and the step's metrics so far
        (a run killed before it logs them logs them on resume). `extra` adds to (or replaces) trainer state
        entries: the asynchronous drivers' loader position and producer state. An I/O error stops the run or
        is logged (trainer.on_checkpoint_error)."""
        assert self.loader is not None
        state = {"dataloader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(), "metrics": metrics}
        self.checkpoints.save(step, self._save_roles, state | (extra or {}), self.cfg.trainer.on_checkpoint_error)

    def _save_roles(self, staging: Path) -> list[OSError | None]:
        """Each trainable role saves under `staging / <role>`; each rank's I/O error comes back, or None."""
        groups = [group for group in (self._roles().actor, self._roles().critic) if group is not None]
        return [error for group in groups for error in group.broadcast(RankWorker.save, str(staging / group.name))]

    def resume(self) -> int:
        """Load `trainer.resume_mode`'s checkpoint into every role and the loader; returns its step (0 if none)."""
        path = self.checkpoints.resolve(self.cfg.trainer.resume_mode)
        if path is None:
            return 0
        roles = self._roles()
        roles.actor.broadcast(ActorWorker.load, str(path / "actor"))
        if roles.critic is not None:
            roles.critic.broadcast(CriticWorker.load, str(path / "critic"))
        state = self.resumed_state = load_trainer_state(path)
        assert self.loader is not None
        self.loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        step = int(state["global_step"])
        if step not in self.tracker.logged_steps():
            self.tracker.log(state["metrics"], step)
        logger.info("resumed from %s (step %d)", path, step)
        return step

    def finish(self) -> None:
        """Close the logs and draw `metrics.png` of the run."""
        self.tracker.close()
        self.scorer.shutdown()
        records = read_metrics(self.run_dir / "metrics.jsonl")
        if records:
            keys = [k for k in DEFAULT_PLOT_KEYS if any(k in r for r in records)]
            if keys:
                logger.info("plot: %s", plot_metrics(records, self.run_dir / "metrics.png", keys))

    def dump(self, batch: Batch, step: int) -> None:
        """`rollout_dumps/step_<k>.jsonl`: prompt, response, score, uid and the weight versions of its tokens."""
        extra: dict[str, list[Any]] = {"uid": [str(uid) for uid in batch["uid"]]}
        if "rollout_versions" in batch:
            extra["versions"] = [sorted({v for v in row.tolist() if v >= 0}) for row in batch["rollout_versions"]]
        texts = decode_prompts(batch, self.tokenizer), list(batch["response_text"])
        path = self.run_dir / "rollout_dumps" / f"step_{step:06d}.jsonl"
        dump_rollouts(path, step, *texts, batch["scores"].tolist(), extra)

    # ---- helpers ----

    def _roles(self) -> Roles:
        assert self.roles is not None, "this mode runs without training roles"
        return self.roles

    def _rollout(self) -> RolloutManager:
        assert self.rollout is not None, "this mode runs without rollout engines"
        return self.rollout

    def _prompt_stream(self) -> Iterator[Batch]:
        """Training prompt batches, epoch after epoch (the loader keeps its position for checkpoints)."""
        if self._prompts is None:
            self._prompts = self._forever()
        return self._prompts

    def _forever(self) -> Iterator[Batch]:
        assert self.loader is not None
        while True:
            yield from self.loader

    @staticmethod
    def due(freq: int, step: int, last: bool) -> bool:
        """Every `freq` steps and at the last (freq 0: only the last)."""
        return last or (freq > 0 and step % freq == 0)

    def validation_due(self, step: int, last: bool) -> bool:
        """Validation runs at this step (`trainer.test_freq`, and a validation set exists)."""
        freq = self.cfg.trainer.test_freq
        return freq > 0 and self.due(freq, step, last) and self.val_loader is not None

    @staticmethod
    def _union(batch: Batch, columns: Batch) -> None:
        for key in columns.tensor_keys:
            batch.set(key, columns[key])

    def _forward(self, group: WorkerGroup[W], method: Callable[[W, Batch], Batch], batch: Batch) -> Batch:
        """`method` over DP shards of equal token counts; rows back in `batch`'s order."""
        with timer("dispatch", self._dispatch):
            ordered, inverse = steps.balanced(batch.select(non_tensor_keys=[], meta_keys=[]), group.dp_size)
        results = group.split_dp(method, ordered)
        with timer("dispatch", self._dispatch):
            return group.from_dp_leaders(results)[inverse]

    def _update(
        self, group: WorkerGroup[W], method: Callable[[W, Batch, int], dict[str, float]], batch: Batch, step: int
    ) -> dict[str, float]:
        with timer("dispatch", self._dispatch):
            ordered, _ = steps.balanced(batch.select(non_tensor_keys=[], meta_keys=[]), group.dp_size)
        return group.split_dp(method, ordered, step)[0]

    def _take_dispatch_seconds(self) -> float:
        """Driver time spent balancing, cutting, shipping and reassembling batches since the last call."""
        groups = [g for g in (self.roles.actor, self.roles.ref, self.roles.critic) if g] if self.roles else []
        seconds = self._dispatch.pop("timing/dispatch", 0.0) + sum(g.dispatch_seconds for g in groups)
        for group in groups:
            group.dispatch_seconds = 0.0
        return seconds
