"""Stand-in for the trainer until it exists: Megatron PPO steps in a loop, with checkpoints and resume.

Two processes train a tiny actor and critic with Adam on batches drawn by a `StatefulDataLoader`
(2 batches per epoch, so runs cross epochs), draw their advantages from the global RNG and
update an adaptive KL controller, so a resume that drops any of these state pieces diverges.
`--layout tp2`: TP=2 with the plain optimizer; `dp2`: DP=2 with the distributed optimizer.

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
from megarl.megatron.dist_ckpt import load_trainable, save_trainable
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
            if step % save_freq == 0:
                staging = staging_dir(root, step)
                if manager:
                    manager.begin(step)
                torch.distributed.barrier()
                save_trainable(actor_state, groups, staging / "actor")
                save_trainable(critic_state, groups, staging / "critic")
                torch.distributed.barrier()
                if step == hang_in_save:
                    (Path(run_dir) / "hanging").touch()
                    time.sleep(3600)
                if manager and save_hf:
                    export_hf(staging / "actor", model_dir)
                if manager:
                    state = {"dataloader": loader.state_dict(), "kl_controller": kl.state_dict(), "history": history}
                    manager.commit(step, state)
                torch.distributed.barrier()
            if step == steps:
                break
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
