"""Stand-in for the trainer until it exists: Megatron PPO steps in a loop, with checkpoints and resume.

Two processes train a tiny actor and critic with Adam on batches drawn by a `StatefulDataLoader`
(2 batches per epoch, so runs cross epochs), draw their advantages from the global RNG and
update an adaptive KL controller, so a resume that drops any of these state pieces diverges.
`--layout tp2`: TP=2 with the plain optimizer, synchronous saves; `dp2`: DP=2 with the distributed optimizer,
asynchronous saves (each written while the next step changes the weights, committed after it).

    python tests/cases/ckpt_train_loop.py --model DIR --run-dir DIR --steps 6 --save-freq 2 [--hang-in-save 4]

`--save-hf`: export the actor as HF safetensors with every checkpoint.
`--hang-in-save K`: after the roles have written step K's checkpoint and before it is committed,
write `<run-dir>/hanging` and sleep, so a test can kill the run mid-save.
Writes `<run-dir>/result.pt`: {"history": [(step, rows, actor loss, critic loss, kl_coef)],
"weights": {hf name: tensor}, "value_head": tensor}.
"""

import argparse
import time
from pathlib import Path

import torch

from cases.megatron_cases import layout, sample_batch
from megarl.algo.kl import AdaptiveKLController
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.training import OptimConfig
from megarl.data.loader import StatefulDataLoader
from megarl.megatron.async_save import AsyncWrites
from megarl.megatron.dist_ckpt import SavePlans, load_trainable, save_trainable, start_save_trainable
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.launch import spawn
from megarl.megatron.losses import PolicyLoss, ValueLoss
from megarl.megatron.model import build_model
from megarl.megatron.optim import Trainable, make_trainable
from megarl.megatron.parallel import RoleGroups, build_role_groups
from megarl.megatron.weights import SafetensorsReader, gather_hf_weights, load_hf_weights
from megarl.models.spec import ModelSpec, load_hf_config, model_spec
from megarl.trainer.checkpoint import CheckpointManager, export_hf, load_trainer_state, staging_dir

NUM_ROWS = 10
BATCH_SIZE = 4


def dp_rows(num_rows: int, groups: RoleGroups) -> torch.Tensor:
    """This DP rank's share of the batch rows."""
    return torch.arange(num_rows).tensor_split(groups.layout.dp)[groups.dp_rank]


def _batch(rows: list[int], vocab_size: int) -> dict[str, torch.Tensor]:
    """Token rows determined by the data rows; advantages from the global RNG."""
    parts = [sample_batch(vocab_size, num_rows=2, seed=row) for row in rows]  # row 1 has no response
    batch = {key: torch.cat([p[key][:1] for p in parts]) for key in parts[0]}
    batch["advantages"] = torch.randn(batch["responses"].shape) * batch["response_mask"]
    return batch


def _role(
    spec: ModelSpec, model_dir: str, groups: RoleGroups, critic: bool, distributed: bool, steps: int
) -> tuple[MegatronEngine, Trainable]:
    model = build_model(spec, groups, value_head=critic)
    load_hf_weights(model, groups, SafetensorsReader(model_dir))
    optim = OptimConfig(name="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, lr_warmup_steps=2)
    trainable = make_trainable(model, groups, optim, use_distributed_optimizer=distributed, total_steps=steps)
    return MegatronEngine(model, groups, trainable), trainable


class Saves:
    """Both roles' checkpoint of a step, committed by rank 0's manager. `asynchronous` (dp2): staged at the step,
    written by megatron-core's writer processes while the next step trains (`AsyncWrites`), committed after it."""

    def __init__(self, manager: CheckpointManager | None, root: Path, asynchronous: bool, hang_in_save: int) -> None:
        self.manager, self.root, self.asynchronous, self.hang_in_save = manager, root, asynchronous, hang_in_save
        self.writes, self.plans = AsyncWrites(), {"actor": SavePlans(), "critic": SavePlans()}
        self.pending: tuple[int, dict] | None = None
        self.hf_from: str | None = None

    def save(self, step: int, roles: dict[str, Trainable], groups: RoleGroups, state: dict) -> None:
        staging = staging_dir(self.root, step)
        if self.manager:
            self.manager.begin(step)
        torch.distributed.barrier()
        if self.asynchronous:
            requests = [start_save_trainable(t, groups, staging / name, self.plans[name]) for name, t in roles.items()]
            self.writes.schedule([request for pair in requests for request in pair])
        else:
            for name, trainable in roles.items():
                save_trainable(trainable, groups, staging / name)
        self.pending = (step, state)
        if not self.asynchronous:
            self.settle()

    def settle(self) -> None:
        """Wait for the pending save's writes; `hang_in_save`'s step hangs here; commit."""
        if self.pending is None:
            return
        step, state = self.pending
        self.writes.finish(blocking=True)
        torch.distributed.barrier()
        if step == self.hang_in_save:
            (self.root.parent / "hanging").touch()
            time.sleep(3600)
        if self.manager and self.hf_from:
            export_hf(staging_dir(self.root, step) / "actor", self.hf_from, lora=False)
        if self.manager:
            self.manager.commit(step, state)
        torch.distributed.barrier()
        self.pending = None


def rank_loop(
    model_dir: str, run_dir: str, steps: int, save_freq: int, hang_in_save: int, role_layout: str, save_hf: bool
) -> None:
    rank = torch.distributed.get_rank()
    spec = model_spec(load_hf_config(model_dir))
    groups = build_role_groups(layout(2, tp=2) if role_layout == "tp2" else layout(2))
    distributed = role_layout == "dp2"
    actor, actor_state = _role(spec, model_dir, groups, False, distributed, steps)
    critic, critic_state = _role(spec, model_dir, groups, True, distributed, steps)
    loss = PolicyLoss(AlgorithmConfig(entropy_coeff=0.01))
    value_loss = ValueLoss(cliprange_value=0.5, loss_agg_mode="token-mean")
    batching = MicroBatching(micro_batch_size=2)
    loader = StatefulDataLoader(list(range(NUM_ROWS)), BATCH_SIZE, collate_fn=list, seed=7)
    kl = AdaptiveKLController(0.1, target_kl=0.05, horizon=10)
    root = Path(run_dir) / "checkpoints"
    manager = CheckpointManager(root, max_to_keep=2) if rank == 0 else None
    saves = Saves(manager, root, asynchronous=distributed, hang_in_save=hang_in_save)
    saves.hf_from = model_dir if save_hf else None
    torch.distributed.barrier()
    resume = [manager.resolve("auto") if manager else None]
    torch.distributed.broadcast_object_list(resume, src=0)
    step, history = 0, []
    if resume[0] is not None:
        state = load_trainer_state(resume[0])
        load_trainable(actor_state, groups, resume[0] / "actor")
        load_trainable(critic_state, groups, resume[0] / "critic")
        loader.load_state_dict(state["dataloader"])
        kl.load_state_dict(state["kl_controller"])
        step, history = state["global_step"], state["history"]
    while step < steps:
        for rows in loader:
            step += 1
            batch = _batch(rows, spec.vocab_size)
            batch = {key: value[dp_rows(len(rows), groups)] for key, value in batch.items()}
            batch["old_log_probs"] = actor.forward(batch, batching)["log_probs"]
            batch["values"] = critic.forward(batch, batching)["values"]
            batch["returns"] = batch["advantages"] + batch["values"]
            critic_metrics = critic.train_step(batch, batching, value_loss)
            metrics = actor.train_step(batch, batching, loss)
            kl.update(abs(metrics["pg_loss"]), num_steps=BATCH_SIZE)
            history.append((step, rows, metrics["loss"], critic_metrics["vf_loss"], kl.value))
            saves.settle()  # dp2: the previous step's asynchronous save, written while this step trained
            if step % save_freq == 0:
                state = {"dataloader": loader.state_dict(), "kl_controller": kl.state_dict(), "history": list(history)}
                saves.save(step, {"actor": actor_state, "critic": critic_state}, groups, state)
            if step == steps:
                break
    saves.settle()
    weights = gather_hf_weights(actor.model, groups)
    value_head = gather_hf_weights(critic.model, groups)["value_head.weight"]
    if rank == 0:
        torch.save({"history": history, "weights": weights, "value_head": value_head}, Path(run_dir) / "result.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-freq", type=int, required=True)
    parser.add_argument("--hang-in-save", type=int, default=-1)
    parser.add_argument("--layout", choices=("tp2", "dp2"), default="tp2")
    parser.add_argument("--save-hf", action="store_true")
    args = parser.parse_args()
    loop_args = (args.model, args.run_dir, args.steps, args.save_freq, args.hang_in_save, args.layout, args.save_hf)
    spawn(rank_loop, 2, *loop_args)


if __name__ == "__main__":
    main()
