"""Process groups of one role (actor, critic or reference), built explicitly.

megatron-core's `parallel_state` holds one global layout per process. Roles that share devices
may want different TP/PP/EP, so each role gets its own `RoleGroups`: a
`ProcessGroupCollection` that is passed to every megatron component the role builds (model,
DDP, optimizer, schedule), never read from globals.

Rank order, fastest-varying first: tp, cp, dp, pp for the dense layers and etp, ep, edp, pp for
the experts — megatron's default `tp-cp-ep-dp-pp`, so both grids agree on the pipeline stages.
"""

from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megarl.config.training import MegatronConfig
from megarl.megatron import cpu_compat


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Sizes of one role's parallel dimensions on a world of `world_size` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    num_layers_in_first_stage: int | None = None
    """Uneven pipeline stages: the first stage's layers (megatron's `num_layers_in_first_pipeline_stage`)."""
    num_layers_in_last_stage: int | None = None
    """Uneven pipeline stages: the last stage's layers (megatron's `num_layers_in_last_pipeline_stage`)."""

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tp×pp×cp = {self.tp}×{self.pp}×{self.cp}"
            )
        if self.world_size % (self.etp * self.ep * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by etp×ep×pp = {self.etp}×{self.ep}×{self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    @classmethod
    def from_config(cls, cfg: MegatronConfig, world_size: int) -> "ParallelLayout":
        tp = cfg.tensor_model_parallel_size
        return cls(
            world_size=world_size,
            tp=tp,
            pp=cfg.pipeline_model_parallel_size,
            cp=cfg.context_parallel_size,
            ep=cfg.expert_model_parallel_size,
            etp=cfg.expert_tensor_parallel_size or tp,
            vpp=cfg.virtual_pipeline_model_parallel_size,
            sequence_parallel=cfg.sequence_parallel,
            num_layers_in_first_stage=cfg.num_layers_in_first_pipeline_stage,
            num_layers_in_last_stage=cfg.num_layers_in_last_pipeline_stage,
        )


@dataclass(frozen=True, slots=True)
class RoleGroups:
    """One role's process groups and this rank's coordinates in them."""

    layout: ParallelLayout
    pgs: ProcessGroupCollection

    @property
    def tp_rank(self) -> int:
        return self.pgs.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pgs.pp.rank()

    @property
    def dp_rank(self) -> int:
        return self.pgs.dp.rank()

    @property
    def ep_rank(self) -> int:
        return self.pgs.ep.rank()

    @property
    def etp_rank(self) -> int:
        return self.pgs.expt_tp.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def _groups_varying(grid: np.ndarray, axes: tuple[int, ...]) -> list[list[int]]:
    """Rank lists that vary along `axes` of `grid` and fix every other axis."""
    fixed = [a for a in range(grid.ndim) if a not in axes]
    moved = np.transpose(grid, fixed + list(axes))
    return moved.reshape(-1, int(np.prod([grid.shape[a] for a in axes]))).tolist()


def _new_group(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def build_role_groups(layout: ParallelLayout) -> RoleGroups:
    """Create the role's groups. Collective: every rank of the world calls it with the same layout."""
    cpu_compat.apply()
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks but the world has {dist.get_world_size()}")
    ranks = np.arange(layout.world_size)
    dense = ranks.reshape(layout.pp, layout.dp, layout.cp, layout.tp)  # axes: pp, dp, cp, tp
    expert = ranks.reshape(layout.pp, layout.edp, layout.ep, layout.etp)  # axes: pp, edp, ep, etp
    pp_lists = _groups_varying(dense, (0,))
    embd_lists = [sorted({g[0], g[-1]}) for g in pp_lists]
    pgs = ProcessGroupCollection(
        tp=_new_group(_groups_varying(dense, (3,))),
        cp=_new_group(_groups_varying(dense, (2,))),
        dp=_new_group(_groups_varying(dense, (1,))),
        pp=_new_group(pp_lists),
        tp_cp=_new_group(_groups_varying(dense, (2, 3))),
        dp_cp=_new_group(_groups_varying(dense, (1, 2))),
        mp=_new_group(_groups_varying(dense, (0, 3))),
        tp_dp_cp=_new_group(_groups_varying(dense, (1, 2, 3))),
        embd=_new_group(embd_lists),
        pos_embd=_new_group([[g[0]] for g in pp_lists]),
        ep=_new_group(_groups_varying(expert, (2,))),
        expt_tp=_new_group(_groups_varying(expert, (3,))),
        tp_ep=_new_group(_groups_varying(expert, (2, 3))),
        tp_ep_pp=_new_group(_groups_varying(expert, (0, 2, 3))),
        expt_dp=_new_group(_groups_varying(expert, (1,))),
    )
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        # dot_product_attention.py takes its scratch buffer from this process-wide pool.
        parallel_state._set_global_memory_buffer()
    pgs.intra_dp_cp = pgs.dp_cp
    pgs.intra_expt_dp = pgs.expt_dp
    # One distributed-optimizer instance spanning the role: gradient norms are reduced over it.
    pgs.intra_dist_opt = _new_group([ranks.tolist()])
    return RoleGroups(layout=layout, pgs=pgs)
