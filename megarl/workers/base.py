"""What every role's rank does: join the role's torch.distributed world, build its Megatron model.

Each role (actor, critic, reference) is its own world of `world_size` Ray actors, one per
bundle of its pool. Roles on one pool share devices but never a process group: the rank's
`RoleGroups` are built from the role's own layout and passed explicitly to everything it builds.
"""

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megarl.batch import MULTI_MODAL_COLUMN, Batch
from megarl.config.lora import LoraConfig
from megarl.config.model import ModelConfig
from megarl.config.training import MegatronConfig, OptimConfig
from megarl.lora.model import apply_lora
from megarl.lora.peft_io import load_adapter_tensors, read_peft
from megarl.megatron.async_save import AsyncWrites
from megarl.megatron.dist_ckpt import load_trainable, save_trainable, start_save_trainable
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.inputs import MicroBatching
from megarl.megatron.losses import MicroBatchLoss
from megarl.megatron.model import BuiltModel, build_model, use_transformer_engine
from megarl.megatron.offload import Offloader, freeze_startup_objects, handover_memory, reserved_bytes
from megarl.megatron.optim import Trainable, make_trainable
from megarl.megatron.parallel import ParallelLayout, RoleGroups, build_role_groups
from megarl.megatron.vision import VisionTraining
from megarl.megatron.weights import HFTensors, SafetensorsReader, SeededInit, load_hf_weights, model_plan
from megarl.models.spec import load_hf_config, model_spec
from megarl.ports import free_port
from megarl.workers.settings import ModelSettings, UpdateSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class DPCoords:
    """Where a rank sits in its role's data-parallel split."""

    dp_rank: int
    dp_size: int
    leader: bool
    """This rank returns its DP shard's outputs (TP rank 0, CP rank 0, first pipeline stage)."""


@dataclass(slots=True)
class RoleModel:
    groups: RoleGroups
    model: BuiltModel
    trainable: Trainable | None
    engine: MegatronEngine


class RankWorker:
    """Base of the per-role Ray actors: process-group set-up, DP coordinates, checkpoints."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.role: RoleModel | None = None
        self.offloader: Offloader | None = None
        self.writes = AsyncWrites()
        """This rank's asynchronous checkpoint writes still in flight."""
        """Set by roles that leave the device to colocated engines (`ref.offload`, `critic.offload`; an actor rank
        hosting the reference: the reference's)."""
        if device == "cpu":
            torch.set_num_threads(1)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the role's TCP store."""
        import ray

        return str(ray.util.get_node_ip_address()), free_port("0.0.0.0")

    def init_process_group(self, address: str, port: int, timeout_s: float) -> None:
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
        backend = "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            backend = "nccl"
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
        )
        from megarl.megatron import cpu_compat

        cpu_compat.apply()

    def _role(self) -> RoleModel:
        assert self.role is not None, "setup() was not called"
        return self.role

    def save(self, path: str, asynchronous: bool = False) -> OSError | None:
        """The role's weights, optimizer, LR schedule and RNG (collective over the role); `asynchronous`: staged now,
        written by a writer process per rank while the rank goes on (`finish_saves` tells when they are done). An I/O
        error (disk full, permission denied) is returned, not raised, for the driver to report: the rank stays
        usable."""
        role = self._role()
        assert role.trainable is not None, "only trainable roles are checkpointed"
        try:
            if asynchronous:
                self.writes.schedule(start_save_trainable(role.trainable, role.groups, path, self.writes.plans))
            else:
                save_trainable(role.trainable, role.groups, path)
        except OSError as err:  # outside megatron's collective writes: a directory, this rank's rank_<r>.pt
            return OSError(err.errno, f"{err.strerror} (rank {self.rank})", err.filename or path)
        except CheckpointException as err:  # a collective write failed: raised on every rank
            return _dcp_write_error(err, path)
        return None

    def finish_saves(self, blocking: bool, path: str) -> bool | OSError:
        """Whether every asynchronous save of this role is written and finalized (waiting for it when `blocking`);
        the I/O error of a writer that failed, on every rank. Collective over the role."""
        try:
            return self.writes.finish(blocking)
        except CheckpointException as err:
            return _dcp_write_error(err, path)

    def load(self, path: str) -> None:
        role = self._role()
        assert role.trainable is not None, "only trainable roles are checkpointed"
        load_trainable(role.trainable, role.groups, path)

    def release(self) -> dict[str, float]:
        """Before the colocated engines wake: this role's offloaded state off the device and the cache emptied.
        Returns the bytes freed (`offload/bytes`) and the device memory the caching allocator reserved before and
        after (`handover/reserved_{before,after}_bytes`; 0 without CUDA); nothing without offload."""
        if self.offloader is None:
            return {}
        before = reserved_bytes()
        freed = self.offloader.offload()
        return {"offload/bytes": float(freed)} | handover_memory(before)

    def restore(self) -> None:
        """After the engines slept: bring the offloaded state back (a no-op without offload)."""
        if self.offloader is not None:
            self.offloader.reload()

    def dp_coords(self) -> DPCoords:
        groups = self._role().groups
        leader = groups.tp_rank == 0 and groups.pgs.cp.rank() == 0 and groups.is_first_stage
        return DPCoords(groups.dp_rank, groups.layout.dp, leader)


def _dcp_write_error(err: CheckpointException, path: str) -> OSError:
    """A failed torch.distributed.checkpoint write as an OSError. Every rank raises; the coordinator's exception
    lists the ranks' failures, as text by then (megatron's writers: `Worker failure: [Errno 28] No space left on
    device`), the others' none: the errno where the text shows one."""
    text = "; ".join(str(failure) for failure, _ in err.failures.values()) or "another rank failed to write"
    found = re.search(r"\[Errno (\d+)\]", text)
    return OSError(int(found.group(1)) if found else None, text, path)


def build_role(
    model_cfg: ModelConfig,
    megatron: MegatronConfig,
    *,
    weights_path: str | None,
    seed: int,
    value_head: bool = False,
    optim: OptimConfig | None = None,
    total_steps: int = 1,
    groups: RoleGroups | None = None,
    lora: LoraConfig | None = None,
) -> RoleModel:
    """Groups (`groups`, those of another role of this process on the same layout, or built from `megatron`),
    model (HF weights from `weights_path`, else a seeded random init), LoRA adapters on it if `lora` (from
    `lora.path`, else fresh), optimizer if `optim`.

    The random init is `SeededInit`'s, the same under every layout; a critic's value head stays zero.
    """
    spec = model_spec(load_hf_config(model_cfg.path))
    if groups is None:
        groups = build_role_groups(ParallelLayout.from_config(megatron, dist.get_world_size()))
    torch.manual_seed(seed)
    use_te = use_transformer_engine(megatron.transformer_impl, on_gpu=torch.cuda.is_available())
    training = VisionTraining(tower=not model_cfg.freeze_vision_tower, projector=model_cfg.train_projector)
    model = build_model(
        spec, groups, DTYPES[model_cfg.dtype], use_te=use_te, value_head=value_head, seed=seed, vision_training=training
    )
    weights: HFTensors = SeededInit(model_plan(model, groups), seed)
    if weights_path is not None:
        weights = SafetensorsReader(weights_path)
    load_hf_weights(model, groups, weights)
    if lora is not None:
        model = with_adapters(model, groups, lora, seed)
    trainable = None
    if optim is not None:
        trainable = make_trainable(model, groups, optim, megatron.use_distributed_optimizer, total_steps)
    freeze_startup_objects()
    return RoleModel(
        groups, model, trainable, MegatronEngine(model, groups, trainable, packing=megatron.sequence_packing)
    )


def build_role_from(settings: ModelSettings, groups: RoleGroups | None = None) -> RoleModel:
    """`build_role` with a role's `ModelSettings` (and `groups` to share)."""
    s = settings
    return build_role(
        s.model,
        s.megatron,
        weights_path=s.weights_path,
        seed=s.seed,
        value_head=s.value_head,
        optim=s.optim,
        total_steps=s.optimizer_steps,
        groups=groups,
        lora=s.lora,
    )


def with_adapters(model: BuiltModel, groups: RoleGroups, lora: LoraConfig, seed: int) -> BuiltModel:
    """`model` with LoRA adapters, loaded from the PEFT folder `lora.path` when set."""
    model = apply_lora(model, groups, lora, seed)
    if lora.path is not None:
        _, tensors = read_peft(lora.path)
        load_adapter_tensors(model, tensors, f"actor.lora.path={lora.path}")
    return model


class GuardStop(RuntimeError):
    """A rank stops the run on purpose (a divergence guard): restarting would meet the same condition."""


@dataclass(slots=True)
class SkipGuard:
    """Counts the optimizer steps a role skipped in a row (`MegatronEngine.train_step`: a non-finite loss or
    gradient) and stops the run at `limit` of them (`trainer.max_skipped_steps`; 0 = never)."""

    role: str
    limit: int
    in_a_row: int = 0

    def record(self, skipped: bool, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.limit and self.in_a_row >= self.limit:
            raise GuardStop(
                f"stopping the run: the {self.role} skipped {self.in_a_row} optimizer steps in a row for a non-finite "
                f"loss or gradient norm, the last in training step {step} (trainer.max_skipped_steps={self.limit}); "
                "the weights are those before the first skip: lower the learning rate, look for NaN/inf in the "
                "rewards and advantages, or resume from an earlier checkpoint"
            )


ENGINE_INPUTS = ("input_ids", "attention_mask", "responses", "response_mask", MULTI_MODAL_COLUMN)


def engine_inputs(batch: Batch, *extra: str) -> dict[str, torch.Tensor]:
    """The tensors the Megatron engine reads, plus the loss's `extra` columns present in `batch`."""
    return {key: batch[key] for key in (*ENGINE_INPUTS, *extra) if key in batch}


def run_updates(
    engine: MegatronEngine,
    shard: Batch,
    *,
    num_mini_batches: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    micro: MicroBatching,
    loss_fn: MicroBatchLoss,
    columns: tuple[str, ...],
    temperature: float,
    norm_length: float,
    guard: SkipGuard,
    step: int,
) -> dict[str, float]:
    """`epochs` passes of `num_mini_batches` optimizer steps over this DP rank's shard; metrics averaged, except
    `skipped_steps` (steps skipped for a non-finite loss or gradient: summed) and `skipped_in_a_row` (`guard`'s
    count after the last, across training steps; it stops the run at its limit).

    Every rank of the role calls this with the same seed, so TP/PP peers cut the same mini-batches.
    """
    if len(shard) % num_mini_batches:
        raise ValueError(f"a DP shard of {len(shard)} rows does not split into {num_mini_batches} mini-batches")
    totals: dict[str, float] = {}
    count = num_skipped = 0
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed + epoch))
        else:
            order = torch.arange(len(shard))
        for rows in order.chunk(num_mini_batches):
            metrics = engine.train_step(
                engine_inputs(shard[rows], *columns), micro, loss_fn, temperature=temperature, norm_length=norm_length
            )
            skipped = metrics.pop("skipped")
            guard.record(skipped > 0, step)
            num_skipped += int(skipped)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            count += 1
    skips = {"skipped_steps": float(num_skipped), "skipped_in_a_row": float(guard.in_a_row)}
    return {key: value / count for key, value in totals.items()} | skips


def update_step(
    engine: MegatronEngine,
    shard: Batch,
    settings: UpdateSettings,
    *,
    loss_fn: MicroBatchLoss,
    columns: tuple[str, ...],
    temperature: float,
    guard: SkipGuard,
    step: int,
) -> dict[str, float]:
    """`run_updates` of step `step` as a role's `UpdateSettings` say (shuffle seed: seed + 1000 × step)."""
    u = settings
    return run_updates(
        engine,
        shard,
        num_mini_batches=u.mini_batches,
        epochs=u.epochs,
        shuffle=u.shuffle,
        seed=u.seed + 1000 * step,
        micro=u.micro,
        loss_fn=loss_fn,
        columns=columns,
        temperature=temperature,
        norm_length=u.norm_length,
        guard=guard,
        step=step,
    )
