"""Routing replay: a MoE model's routers pick the experts recorded elsewhere instead of their own top-k.

R3 replays the rollout engine's choices (SGLang's `return_routed_experts`), R2 the ones the
trainer's own old-log-prob pass recorded. The expert *indices* are replayed; their weights are the
live router's scores gathered at those indices, so the router still gets gradients.

Routings travel as a batch column `routed_experts [b, s, moe_layers·k]` (`batch.routing_dtype`) aligned
with `input_ids`: `[i, t, j·k:(j+1)·k]` holds the k experts the j-th MoE layer (in decoder order; dense
layers have no entries, `agents.postprocess.RoutingLayout`) sent token t of row i to; -1 where there is
no record (padding, the last token of a sequence: the engine never forwarded it, a tool token appended
after the final turn). A token without a record is routed by the live router.

megatron-core builds one `RouterReplay` per router when `moe_enable_routing_replay` is set and
keeps them in a process-wide list in construction order
(megatron/core/transformer/moe/router_replay.py). megarl installs its own subclass per router
instead, keyed by the router's MoE-layer ordinal, so that replay works per token (with fallback),
counts the tokens whose live top-k differs from the record, and does not depend on what else the
process built. Activation recomputation would call each router twice; megarl does not recompute
activations, so forward replay is all there is.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from megarl.batch import NO_RECORD


class TokenReplay(RouterReplay):
    """One router's replay: per token, the recorded experts where there is a record, else its own top-k."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # megarl reaches its replays by layer
        self.layer = layer
        """0-based MoE-layer ordinal (dense layers not counted): this router's slot in `routed_experts`."""
        self.differs: Tensor | None = None
        """[n] after a replayed forward: the live top-k differs from the record (as a set)."""
        self.recorded_mask: Tensor | None = None
        """[n] after a replayed forward: the token had a record."""

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`scores` [n, experts] as megatron's `topk_routing_with_score_function` passes them; returns (the
        scores at the chosen experts, their indices) [n, k], as its `compute_topk` does."""
        assert default_compute_topk is not None, "megatron passes its own top-k"
        probs, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.router_replay_action == RouterReplayAction.RECORD:
            self.record_indices(live.detach())
            return probs, live
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or self.target_topk_idx is None:
            return probs, live
        target = self.target_topk_idx.to(device=scores.device, dtype=torch.long)  # [n, k]
        have = target[:, 0] >= 0
        self.recorded_mask = have
        self.differs = have & (live.sort(dim=1).values != target.sort(dim=1).values).any(dim=1)
        indices = torch.where(have.unsqueeze(1), target, live)
        self.record_indices(indices.detach())
        return scores.gather(1, indices), indices


def _beyond(source: Tensor, lengths: Tensor) -> Tensor:
    """[b, A]: aligned columns past each row's length."""
    return torch.arange(source.shape[1], device=source.device).unsqueeze(0) >= lengths.unsqueeze(1)


def aligned_routing(routed: Tensor, source: Tensor, lengths: Tensor) -> Tensor:
    """`routed [b, s, M, k]` (M MoE layers) → `[b, A, M, k]` gathered at `source [b, A]` (the columns `align_left`
    takes), -1 past each row's `lengths`."""
    index = source[:, :, None, None].expand(-1, -1, *routed.shape[2:])
    return routed.gather(1, index).masked_fill(_beyond(source, lengths)[:, :, None, None], NO_RECORD)


def unaligned_routing(aligned: Tensor, source: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Inverse of `aligned_routing`: `[b, A, L, k]` → `[b, width, L, k]`, -1 on columns no aligned token came from."""
    rows, _, num_layers, topk = aligned.shape
    out = torch.full((rows, width + 1, num_layers, topk), NO_RECORD, dtype=aligned.dtype)
    target = source.masked_fill(_beyond(source, lengths), width)  # tokens past the length land in a spare column
    out.scatter_(1, target[:, :, None, None].expand_as(aligned), aligned)
    return out[:, :width]


class RoutingReplay:
    """The routers of one model (all its chunks), each with a `TokenReplay`, and the per-micro-batch plumbing:
    targets in, records and mismatch counts out, in the routers' token order.

    A router sees its stage's tokens as megatron lays them out: `[s, b]` flattened sequence-major, and
    under sequence parallelism only this TP rank's s/tp slice.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        tp_group: dist.ProcessGroup,
        sequence_parallel: bool,
        moe_layers: tuple[bool, ...],
    ) -> None:
        """`moe_layers`: per decoder layer, whether it routes (`ModelSpec.moe_layers`)."""
        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in routers:
            if router.config.moe_router_fusion:
                raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion=False)")
            layer = router.layer_number - 1  # megatron numbers decoder layers from 1, across PP stages
            assert moe_layers[layer], f"decoder layer {layer} has a router but the spec says it is dense"
            router.router_replay = TokenReplay(sum(moe_layers[:layer]))
        self.replays: list[TokenReplay] = [r.router_replay for r in routers]
        self.tp_group = tp_group
        self.split = tp_group.size() if sequence_parallel else 1
        self.rank = tp_group.rank() if sequence_parallel else 0

    def _local(self, aligned: Tensor) -> Tensor:
        """`[b, A, ...]` → this rank's tokens `[A/split · b, ...]` in router order."""
        by_position = aligned.transpose(0, 1)  # [A, b, ...]
        width = by_position.shape[0] // self.split
        mine = by_position[self.rank * width : (self.rank + 1) * width]
        return mine.reshape(-1, *mine.shape[2:])

    def replay(self, aligned: Tensor) -> None:
        """Before a micro-batch's forward: every router replays `aligned [b, A, moe_layers, k]`."""
        local = self._local(aligned)  # [n, moe_layers, k]
        for replay in self.replays:
            replay.clear_indices()
            replay.set_target_indices(local[:, replay.layer])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def record(self) -> None:
        """Before a micro-batch's forward: every router records its own top-k."""
        for replay in self.replays:
            replay.clear_indices()
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def off(self) -> None:
        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
            replay.differs = replay.recorded_mask = None

    def mismatches(self, rows: int, row_of: Tensor | None = None) -> Tensor:
        """After a replayed forward: per row `[rows, 2]` (tokens×layers whose live top-k differed from the record,
        tokens×layers with a record) on this rank's routers and tokens; `row_of` `[t]`: a packed micro-batch's row
        of each of its tokens (`[1, t]`), else the micro-batch's rows are its `rows` batch rows."""
        counts = torch.zeros(rows, 2, dtype=torch.float64)
        for replay in self.replays:
            if replay.differs is None or replay.recorded_mask is None:
                continue
            pair = torch.stack([replay.differs, replay.recorded_mask], dim=1).to(device="cpu", dtype=torch.float64)
            if row_of is None:
                counts += pair.reshape(-1, rows, 2).sum(dim=0)  # [A/split, b, 2] summed over positions
            else:
                counts.index_add_(0, self._local(row_of.unsqueeze(0)).cpu(), pair)
        return counts

    def recorded(self, rows: int, width: int, num_moe_layers: int, topk: int) -> Tensor:
        """After a forward of `[b=rows, A=width]` tokens: the experts this stage's routers used `[b, A, moe_layers,
        k]` int32 (-1 on the other stages' MoE layers), gathered over the sequence-parallel ranks."""
        out = torch.full((rows, width, num_moe_layers, topk), NO_RECORD, dtype=torch.int32)
        if not self.replays:
            return out
        local = torch.stack([r.get_recorded_indices() for r in self.replays], dim=1)  # [n, layers here, k]
        local = local.to(torch.int32).reshape(-1, rows, len(self.replays), topk)  # [A/split, b, layers here, k]
        if self.split > 1:
            parts = [torch.empty_like(local) for _ in range(self.split)]  # int32: gloo gathers no int16
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
            local = torch.cat(parts)
        for j, replay in enumerate(self.replays):
            out[:, :, replay.layer] = local[:, :, j].transpose(0, 1).cpu()
        return out
