"""What every role's rank does: join the role's torch.distributed world, build its Megatron model.

Each role (actor, critic, reference) is its own world of `world_size` Ray actors, one per
bundle of its pool. Roles on one pool share devices but never a process group: the rank's
`RoleGroups` are built from the role's own layout and passed explicitly to everything it builds.
"""

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.config.model import ModelConfig
from megarl.config.training import MegatronConfig, OptimConfig
from megarl.megatron.dist_ckpt import load_trainable, save_trainable
from megarl.megatron.engine import MegatronEngine, MicroBatching
from megarl.megatron.losses import MicroBatchLoss
from megarl.megatron.model import BuiltModel, build_model, use_transformer_engine
from megarl.megatron.offload import Offloader
from megarl.megatron.optim import Trainable, make_trainable
from megarl.megatron.parallel import ParallelLayout, RoleGroups, build_role_groups
from megarl.megatron.weights import HFTensors, SafetensorsReader, SeededInit, load_hf_weights, model_plan
from megarl.models.spec import load_hf_config, model_spec
from megarl.protocol import Batch

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
        """Set by roles that leave the device to colocated engines (`ref.offload`, `critic.offload`)."""
        if device == "cpu":
            torch.set_num_threads(1)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the role's TCP store."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return str(ray.util.get_node_ip_address()), port

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

    def save(self, path: str) -> None:
        """The role's weights, optimizer, LR schedule and RNG (collective over the role)."""
        role = self._role()
        assert role.trainable is not None, "only trainable roles are checkpointed"
        save_trainable(role.trainable, role.groups, path)

    def load(self, path: str) -> None:
        role = self._role()
        assert role.trainable is not None, "only trainable roles are checkpointed"
        load_trainable(role.trainable, role.groups, path)

    def release(self) -> int:
        """Before the colocated engines wake: move this role's offloaded state to host memory; bytes freed."""
        return 0 if self.offloader is None else self.offloader.offload()

    def restore(self) -> None:
        """After the engines slept: bring the offloaded state back (a no-op without offload)."""
        if self.offloader is not None:
            self.offloader.reload()

    def dp_coords(self) -> DPCoords:
        groups = self._role().groups
        leader = groups.tp_rank == 0 and groups.pgs.cp.rank() == 0 and groups.is_first_stage
        return DPCoords(groups.dp_rank, groups.layout.dp, leader)


def build_role(
    model_cfg: ModelConfig,
    megatron: MegatronConfig,
    *,
    weights_path: str | None,
    seed: int,
    value_head: bool = False,
    optim: OptimConfig | None = None,
    total_steps: int = 1,
) -> RoleModel:
    """Groups, model (HF weights from `weights_path`, else a seeded random init), optimizer if `optim`.

    The random init is `SeededInit`'s, the same under every layout; a critic's value head stays zero.
    """
    spec = model_spec(load_hf_config(model_cfg.path))
    groups = build_role_groups(ParallelLayout.from_config(megatron, dist.get_world_size()))
    torch.manual_seed(seed)
    use_te = use_transformer_engine(megatron.transformer_impl, on_gpu=torch.cuda.is_available())
    model = build_model(spec, groups, DTYPES[model_cfg.dtype], use_te=use_te, value_head=value_head, seed=seed)
    weights: HFTensors = SeededInit(model_plan(model, groups), seed)
    if weights_path is not None:
        weights = SafetensorsReader(weights_path)
    load_hf_weights(model, groups, weights)
    trainable = None
    if optim is not None:
        trainable = make_trainable(model, groups, optim, megatron.use_distributed_optimizer, total_steps)
    return RoleModel(groups, model, trainable, MegatronEngine(model, groups, trainable))


ENGINE_INPUTS = ("input_ids", "attention_mask", "responses", "response_mask")


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
) -> dict[str, float]:
    """`epochs` passes of `num_mini_batches` optimizer steps over this DP rank's shard; metrics averaged.

    Every rank of the role calls this with the same seed, so TP/PP peers cut the same mini-batches.
    """
    if len(shard) % num_mini_batches:
        raise ValueError(f"a DP shard of {len(shard)} rows does not split into {num_mini_batches} mini-batches")
    totals: dict[str, float] = {}
    count = 0
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed + epoch))
        else:
            order = torch.arange(len(shard))
        for rows in order.chunk(num_mini_batches):
            metrics = engine.train_step(
                engine_inputs(shard[rows], *columns), micro, loss_fn, temperature=temperature, norm_length=norm_length
            )
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            count += 1
    return {key: value / count for key, value in totals.items()}
