"""A mini-batch as the engine's micro-batches: which rows go together, and each one's token layout.

Rows are trajectories (`input_ids`/`attention_mask` `[b, s]`, prompt left-padded, response right-padded, the
response the last r columns). A micro-batch is packed (THD, `megarl.megatron.packing.pack`) or left-aligned and
trimmed to its longest row (`align_left`). With routing replay, its `routed_experts` `[b, s, moe_layers·k]` are laid
out as the model's tokens (`routed_aligned`), and a packed one says where each of its tokens came from
(`pack_positions`, `pack_rows`, `token_index`) so records and mismatch counts go back to the rows.

- Budgets (`use_dynamic_bsz`): `max_token_len` counts what the model computes: a packed micro-batch's real tokens
  (each row rounded up to the alignment), a padded one's rows × longest row.
- Expert-parallel peers run the same number of micro-batches, each of one length: both are agreed (MAX over
  `tp_ep`, megatron's token dispatchers exchange fixed-size routing maps there). A rank with fewer micro-batches
  splits its largest, and with fewer rows than the count runs fillers: row 0 with no response token, whose
  outputs are dropped and whose loss is 0.
- Context parallelism (packed only): each row is rounded up to 2·CP (× TP under sequence parallelism) and this
  rank keeps its chunks of the pack (`megarl.models.context_parallel`); `cp_slot` `[b, r]` is the local position
  whose logits predict each response token, −1 where another CP rank holds it.
- `padding_mask` `[b, s]` (this rank's tokens; True on padding): a MoE model's routers leave those tokens out of the
  auxiliary load-balancing loss (megatron-core 0.16 `TopKRouter.routing`); not yet for routers with an expert bias
  (`routing_padding`).
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.batch import MULTI_MODAL_COLUMN
from megarl.megatron.micro_batches import split_by_count, split_by_token_budget
from megarl.megatron.packing import align_left, aligned_length, left_alignment, pack, packed_length, packed_routing
from megarl.megatron.parallel import RoleGroups
from megarl.megatron.router_replay import aligned_routing
from megarl.megatron.vision import aligned_layout, packed_layout
from megarl.models.context_parallel import local_positions
from megarl.models.packed_attention import token_rows
from megarl.models.vision import VisionSpec


@dataclass(frozen=True, slots=True)
class MicroBatching:
    micro_batch_size: int = 4
    """Rows per micro-batch when not use_dynamic_bsz."""
    use_dynamic_bsz: bool = False
    max_token_len: int = 16384
    """Token budget per micro-batch when use_dynamic_bsz: real tokens packed, rows × longest row padded."""


class InputBuilder:
    """Cuts a role's batches into micro-batches on its process groups (module docstring)."""

    def __init__(
        self,
        groups: RoleGroups,
        is_moe: bool,
        num_moe_layers: int,
        device: torch.device | None,
        packing: bool,
        vision: VisionSpec | None = None,
    ) -> None:
        layout = groups.layout
        if layout.cp > 1 and not packing:
            raise ValueError("context_parallel_size > 1 needs sequence_packing=True (CP splits packed sequences)")
        self.groups = groups
        self.vision = vision
        """A vision-language model's: its rows carry `multi_modal_inputs` and get M-RoPE positions `[3, b, s]`."""
        self.agrees = is_moe and layout.ep > 1
        self.num_moe_layers = num_moe_layers
        """MoE layers: `routed_experts` holds only theirs (`megarl.megatron.router_replay`)."""
        self.device = device
        self.packing = packing
        sequence_parallel = layout.tp if layout.sequence_parallel else 1
        self.multiple = sequence_parallel * (2 * layout.cp if layout.cp > 1 else 1)
        """Every row (packed) or the width (padded) is a multiple of this."""

    def split(self, batch: dict[str, Tensor], batching: MicroBatching) -> list[list[int]]:
        """Row indices per micro-batch; an empty list is a filler."""
        mask = batch["attention_mask"]
        if batching.use_dynamic_bsz:
            lengths = (-(-mask.sum(dim=1) // self.multiple) * self.multiple).tolist()
            bins = split_by_token_budget(lengths, batching.max_token_len, packed=self.packing)
        else:
            bins = split_by_count(mask.shape[0], batching.micro_batch_size)
        if not self.agrees:
            return bins
        return _stretch(bins, self._agreed(len(bins)), mask.sum(dim=1).tolist())

    def prepare(self, batch: dict[str, Tensor], rows: list[int], replay: bool) -> dict[str, Any]:
        """One micro-batch's columns on the device, with its model inputs (`aligned_ids`, `position_ids`,
        `logit_index`, and `packed_seq_params`/`cp_slot` when packed) and `tokens` (real, computed)."""
        index = torch.tensor(rows or [0])
        micro: dict[str, Any] = {
            key: value[index].to(self.device or "cpu") for key, value in batch.items() if key != MULTI_MODAL_COLUMN
        }
        if self.vision is not None:
            images = batch.get(MULTI_MODAL_COLUMN)  # a text-only batch has none
            micro[MULTI_MODAL_COLUMN] = [images[i] if images is not None else None for i in index.tolist()]
        micro["rows"] = torch.tensor(rows, dtype=torch.long)
        if not rows:
            micro["response_mask"] = torch.zeros_like(micro["response_mask"])
        if self.packing:
            self._packed(micro, replay)
        else:
            self._padded(micro, replay)
        real = int(micro["attention_mask"].sum()) if rows else 0
        micro["tokens"] = (real, int(micro["seq_length"]) * micro["aligned_ids"].shape[0])
        return micro

    def _padded(self, micro: dict[str, Any], replay: bool) -> None:
        width = self._agreed(aligned_length(micro["attention_mask"], self.multiple))
        ids, positions, logit_index = align_left(
            micro["input_ids"], micro["attention_mask"], micro["responses"].shape[1], width
        )
        micro.update(aligned_ids=ids, position_ids=positions, logit_index=logit_index, seq_length=width)
        cols = torch.arange(width, device=ids.device)
        micro["padding_mask"] = cols.unsqueeze(0) >= micro["attention_mask"].sum(dim=1, keepdim=True)
        if self.vision is not None:
            source, _ = left_alignment(micro["attention_mask"], width)
            aligned_layout(micro, self.vision, source)
        if not replay:
            return
        source, lengths = left_alignment(micro["attention_mask"], width)
        micro.update(align_source=source, align_lengths=lengths)
        if "routed_experts" in micro:
            flat = micro.pop("routed_experts")  # [b, s, moe_layers·k]
            routed = flat.view(*flat.shape[:2], self.num_moe_layers, -1)
            micro["routed_aligned"] = aligned_routing(routed, source, lengths)

    def _packed(self, micro: dict[str, Any], replay: bool) -> None:
        mask = micro["attention_mask"]
        total = self._agreed(packed_length(mask, self.multiple))
        packed = pack(micro["input_ids"], mask, micro["responses"].shape[1], self.multiple, total)
        micro.update(
            aligned_ids=packed.ids,
            position_ids=packed.positions,
            logit_index=packed.logit_index,
            packed_seq_params=packed.params,
            seq_length=packed.ids.shape[1],
        )
        pad = torch.ones_like(packed.ids, dtype=torch.bool)
        pad[0, packed.token_index[packed.token_index >= 0]] = False
        if self.vision is not None:
            packed_layout(micro, self.vision, packed.token_index, packed.ids.shape[1])
        cu_padded = packed.params.cu_seqlens_q_padded
        mine = torch.arange(packed.ids.shape[1], device=packed.ids.device)
        cp = self.groups.pgs.cp
        if cp.size() > 1:
            mine = local_positions(cu_padded, cp.size(), cp.rank())
            slot = torch.full((packed.ids.shape[1],), -1, dtype=torch.long, device=mine.device)
            slot[mine] = torch.arange(len(mine), device=mine.device)
            micro["aligned_ids"] = packed.ids[:, mine]
            if self.vision is None:
                micro["position_ids"] = packed.positions[:, mine]
            else:  # whole-pack M-RoPE positions (megarl.megatron.mrope); the images need the whole pack's ids
                micro.update(packed_ids=packed.ids, cp_local=mine)
            micro["cp_slot"] = slot[packed.logit_index]
        micro["padding_mask"] = pad[:, mine]
        if replay:
            row, _ = token_rows(cu_padded, packed.ids.shape[1])
            micro.update(pack_positions=mine, pack_rows=row[mine], token_index=packed.token_index)
        if replay and "routed_experts" in micro:
            flat = micro.pop("routed_experts")  # [b, s, moe_layers·k]
            routed = packed_routing(flat.view(*flat.shape[:2], self.num_moe_layers, -1), packed.token_index, total)
            micro["routed_aligned"] = routed[mine].unsqueeze(0)  # [1, t / cp, moe_layers, k]: the model's tokens

    def _agreed(self, value: int) -> int:
        """`value`, or with expert parallelism the largest across the expert-parallel peers."""
        if not self.agrees:
            return value
        agreed = torch.tensor([value], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.groups.pgs.tp_ep)
        return int(agreed.item())


def _stretch(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`bins` made `count` micro-batches: the one with the most tokens halved while it has two rows, then fillers."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        largest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(largest)
        half = len(largest) // 2
        bins += [largest[:half], largest[half:]]
    return bins


def routing_padding(padding_mask: Tensor, sp_group: Any) -> Tensor:
    """A micro-batch's `padding_mask` as a chunk's `padding_mask` argument takes it (megatron-core 0.16
    `GPTModel.forward`, `[b, s]`, True on padding), given the chunk its input embeddings (`decoder_input`) or its
    previous stage's output: megatron then passes it to the routers as it is, so under sequence parallelism (the TP
    group `sp_group`) it gets this TP rank's part of the sequence. (Given ids, megatron would split it itself, with
    the global TP group of `parallel_state`, which megarl's process groups leave unset.) Not for routers with an
    expert bias (sigmoid routing: GLM-4.5, DeepSeek-V3): megatron-core 0.16.1 `TopKRouter._apply_expert_bias` ands
    the `[tokens, experts]` routing map with the `[tokens]` mask, which does not broadcast."""
    if sp_group is None:
        return padding_mask
    return padding_mask.chunk(sp_group.size(), dim=1)[sp_group.rank()]
