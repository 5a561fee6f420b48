"""One role's Megatron engine: log-probs / values forward and a training step over micro-batches.

Input rows are trajectories: `input_ids`/`attention_mask` `[b, s]` (prompt left-padded, response
right-padded) and `responses` `[b, r]` = the last r columns. `megarl.megatron.inputs` cuts them into micro-batches,
packed (THD: the rows' real tokens one after the other, attention within each row) or, without packing,
left-aligned and trimmed to the longest row; under context parallelism each rank holds its chunks
of every packed row. Outputs come back as `[b, r]`, zero where a row has no response token, on every rank of the
role.
"""

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from torch import Tensor

from megarl.algo.aggregation import LossNormalizer
from megarl.batch import MULTI_MODAL_COLUMN, NO_RECORD, routing_dtype
from megarl.megatron.inputs import InputBuilder, MicroBatching, routing_padding
from megarl.megatron.logprobs import vocab_parallel_log_probs
from megarl.megatron.losses import MicroBatchLoss
from megarl.megatron.model import BuiltModel
from megarl.megatron.optim import Trainable, all_finite
from megarl.megatron.packing import unpacked_routing
from megarl.megatron.parallel import RoleGroups
from megarl.megatron.router_replay import RoutingReplay, unaligned_routing
from megarl.megatron.vision import decoder_input
from megarl.models.context_parallel import sum_of_parts

SUMMED_METRICS = ("loss", "pg_loss", "vf_loss", "kl_loss", "entropy")
"""Metrics normalised by mini-batch-wide counts: their micro-batch and DP values add up."""


class MegatronEngine:
    """Forward and update of one role's model on its process groups."""

    def __init__(
        self,
        model: BuiltModel,
        groups: RoleGroups,
        trainable: Trainable | None = None,
        chunk_tokens: int = 4096,
        packing: bool = False,
    ) -> None:
        """`packing`: micro-batches as packed sequences (`megarl.megatron.packing`) instead of left-aligned rows."""
        self.model = model
        self.groups = groups
        self.trainable = trainable
        self.chunk_tokens = chunk_tokens
        self.chunks: list[torch.nn.Module] = list(trainable.chunks) if trainable else list(model.chunks)
        layout = groups.layout
        self._schedule = get_forward_backward_func(pp_size=layout.pp, vp_size=layout.vpp)
        self._p2p = P2PCommunicator(groups.pgs.pp, model.config) if layout.pp > 1 else None
        self._last_stage_rank = dist.get_global_rank(groups.pgs.pp, layout.pp - 1)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.inputs = InputBuilder(
            groups, model.spec.is_moe, model.spec.num_moe_layers, self.device, packing, model.spec.vision
        )
        self.routing: RoutingReplay | None = None
        self._recording = False
        self._mismatches: list[tuple[Tensor, Tensor]] = []
        """Per replayed micro-batch of the current pass: (rows, [b, 2] mismatch counts)."""
        self._records: list[tuple[Tensor, Tensor]] = []
        """Per micro-batch of the current recording pass: (rows, the routing used [b, s, moe_layers, k])."""

    def enable_routing_replay(self) -> None:
        """Give every MoE router a `TokenReplay`: batches with a `routed_experts` column are then routed by it."""
        layout, spec = self.groups.layout, self.model.spec
        self.routing = RoutingReplay(self.chunks, self.groups.pgs.tp, layout.sequence_parallel, spec.moe_layers)

    # ---- forward ----

    def _outputs(
        self, micro: dict[str, Tensor], output: Tensor, temperature: float, extras: tuple[str, ...]
    ) -> dict[str, Tensor]:
        """`[b, r]` log-probs and `extras` (or values) of the micro-batch's response tokens. Under context
        parallelism each rank computes the tokens whose logits it holds and the ranks' parts are summed."""
        if "cp_slot" not in micro:
            return self._token_outputs(micro, output, micro["logit_index"], micro["responses"], temperature, extras)
        owned = micro["cp_slot"] >= 0
        slots, responses = micro["cp_slot"][owned], micro["responses"][owned]
        held = len(slots) > 0
        if not held:  # this rank holds none: one token computed for nothing keeps the loss on the model's graph
            slots, responses = slots.new_zeros(1), micro["responses"].flatten()[:1]
        parts = self._token_outputs(micro, output, slots.unsqueeze(0), responses.unsqueeze(0), temperature, extras)
        combined = {}
        for name, part in parts.items():
            full = part.new_zeros(owned.shape)
            if held:
                full[owned] = part[0]
            else:
                full = full + part.sum() * 0
            combined[name] = sum_of_parts(full, self.groups.pgs.cp)
        return combined

    def _token_outputs(
        self,
        micro: dict[str, Tensor],
        output: Tensor,
        logit_index: Tensor,
        responses: Tensor,
        temperature: float,
        extras: tuple[str, ...],
    ) -> dict[str, Tensor]:
        """Stats of the tokens `responses` predicted by the logits at `logit_index` (both `[n, m]`)."""
        if "packed_seq_params" in micro:
            picked = output[0, logit_index]  # [1, t, ·] → [n, m, ·]
        else:
            picked = output.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
        if self.model.value_head:
            return {"values": picked.squeeze(-1).float()}  # [n, m, 1] from the value head
        stats = vocab_parallel_log_probs(
            picked,
            responses,
            self.groups.pgs.tp,
            self.model.spec.vocab_size,
            temperature,
            extras=extras,
            chunk_tokens=self.chunk_tokens,
        )
        return {"log_probs": stats.log_probs} | {name: getattr(stats, name) for name in extras}

    def _loss_func(
        self,
        micro: dict[str, Tensor],
        output: Tensor,
        *,
        temperature: float,
        loss_fn: MicroBatchLoss | None,
        normalizer: LossNormalizer | None,
        extras: tuple[str, ...],
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        one = torch.ones((), dtype=torch.int)
        if loss_fn is None:
            outputs = self._outputs(micro, output, temperature, extras)
            return output.new_zeros(()), one, {"rows": micro["rows"], **{k: v.detach() for k, v in outputs.items()}}
        assert normalizer is not None
        outputs = self._outputs(micro, output, temperature, ("entropy",) if loss_fn.needs_entropy else ())
        loss, metrics = loss_fn(micro, outputs, normalizer)
        filler = len(micro["rows"]) == 0
        return loss, one, {"loss": loss.detach(), "filler": filler, **{k: v.detach() for k, v in metrics.items()}}

    def _forward_step(self, loss_factory: partial, data_iterator: Iterator, model: torch.nn.Module) -> tuple:
        micro = next(data_iterator)
        self._route(micro)
        output = model(micro["aligned_ids"], micro["position_ids"], None, **self._model_inputs(model, micro))
        self._collect_routing(micro)
        return output, partial(loss_factory, micro)

    def _model_inputs(self, model: torch.nn.Module, micro: dict[str, Any]) -> dict[str, Any]:
        """The chunk's keyword inputs: `packed_seq_params`; a vision-language first stage's `decoder_input`, the
        input embeddings with the micro-batch's images (`megarl.megatron.vision`; elsewhere the chunk embeds its ids
        itself); a MoE model's `padding_mask` (`megarl.megatron.inputs.routing_padding`; under sequence parallelism its
        first stage embeds the ids here, since megatron-core's own split of the mask needs its global TP group)."""
        chunk: Any = model
        while not hasattr(chunk, "pre_process"):
            chunk = chunk.module
        sp_group = self.groups.pgs.tp if self.groups.layout.sequence_parallel else None
        inputs = {"packed_seq_params": micro.get("packed_seq_params"), "decoder_input": None}
        if self.model.spec.vision is not None and chunk.pre_process:
            ids = micro.get("packed_ids", micro["aligned_ids"])  # under CP: the whole pack; it holds `cp_local`
            rows = micro[MULTI_MODAL_COLUMN]
            inputs["decoder_input"] = decoder_input(
                chunk, ids, micro["image_mask"], rows, sp_group, micro.get("cp_local")
            )
        if self.model.spec.is_moe and not self.model.spec.moe_expert_bias:  # see `routing_padding`
            if sp_group is not None and chunk.pre_process and inputs["decoder_input"] is None:
                inputs["decoder_input"] = chunk.embedding(input_ids=micro["aligned_ids"], position_ids=None)
            inputs["padding_mask"] = routing_padding(micro["padding_mask"], sp_group)
        return inputs

    # ---- routing replay ----

    def _route(self, micro: dict[str, Tensor]) -> None:
        """Before a micro-batch's forward: replay its routing, record the routers' own, or neither."""
        if self.routing is None:
            return
        self.routing.off()
        if "routed_aligned" in micro:
            self.routing.replay(micro["routed_aligned"])
        elif self._recording:
            self.routing.record()

    def _collect_routing(self, micro: dict[str, Tensor]) -> None:
        if self.routing is None or len(micro["rows"]) == 0:  # none, or a filler (`megarl.megatron.inputs`)
            return
        rows = micro["rows"]
        num_rows, width = micro["aligned_ids"].shape
        if "routed_aligned" in micro:
            self._mismatches.append((rows, self.routing.mismatches(len(rows), micro.get("pack_rows"))))
        if not self._recording:
            return
        spec = self.model.spec
        aligned = self.routing.recorded(num_rows, width, spec.num_moe_layers, spec.moe_topk)
        if "pack_rows" in micro:  # [1, t / cp, ...] → the pack (no record where another CP rank holds it) → rows
            full = torch.full((int(micro["seq_length"]), *aligned.shape[2:]), NO_RECORD, dtype=aligned.dtype)
            full[micro["pack_positions"].cpu()] = aligned[0]
            self._records.append((rows, unpacked_routing(full, micro["token_index"].cpu())))
            return
        source, lengths = micro["align_source"].cpu(), micro["align_lengths"].cpu()
        self._records.append((rows, unaligned_routing(aligned, source, lengths, micro["input_ids"].shape[1])))

    def _routing_results(self, shape: tuple[int, ...]) -> dict[str, Tensor]:
        """After a pass over `[b, s]` rows: `routing_mismatch`/`routing_tokens` `[b]` (replayed) and/or
        `routed_experts` `[b, s, moe_layers·k]` (recorded; the column's layout and dtype), summed / merged over TP, PP
        and CP peers."""
        (mismatches, self._mismatches), (records, self._records) = (self._mismatches, []), (self._records, [])
        out: dict[str, Tensor] = {}
        if mismatches:
            counts = torch.zeros(shape[0], 2, dtype=torch.float64)
            for rows, part in mismatches:
                counts[rows.cpu()] += part
            counts = self._sum_over_model_parallel(counts)
            out |= {"routing_mismatch": counts[:, 0].float(), "routing_tokens": counts[:, 1].float()}
        if records:
            spec = self.model.spec
            routed = torch.full((*shape, spec.num_moe_layers, spec.moe_topk), NO_RECORD, dtype=torch.int32)
            for rows, part in records:
                routed[rows.cpu()] = part.to(torch.int32)
            for group in (self.groups.pgs.pp, self.groups.pgs.cp):  # each holds its stage's layers, its chunks
                if group.size() > 1:
                    routed = self._on_comm_device(routed)
                    dist.all_reduce(routed, op=dist.ReduceOp.MAX, group=group)
            out["routed_experts"] = routed.cpu().to(routing_dtype(spec.num_experts)).flatten(2)
        return out

    def _sum_over_model_parallel(self, tensor: Tensor) -> Tensor:
        tensor = self._on_comm_device(tensor)
        for group in (self.groups.pgs.tp, self.groups.pgs.pp, self.groups.pgs.cp):
            if group.size() > 1:
                dist.all_reduce(tensor, group=group)
        return tensor.cpu()

    def _run(
        self,
        micros: list[dict[str, Any]],
        forward_only: bool,
        loss_factory: partial,
    ) -> list[dict[str, Any]]:
        num_chunks = len(self.chunks)
        iterator: Any = iter(micros) if num_chunks == 1 else [iter(micros) for _ in range(num_chunks)]
        return self._schedule(
            forward_step_func=partial(self._forward_step, loss_factory),
            data_iterator=iterator,
            model=self.chunks if num_chunks > 1 else self.chunks[0],
            num_microbatches=len(micros),
            seq_length=max(m["seq_length"] for m in micros),
            micro_batch_size=max(m["aligned_ids"].shape[0] for m in micros),
            forward_only=forward_only,
            p2p_communicator=self._p2p,
            pg_collection=self.groups.pgs,
        )

    @torch.no_grad()
    def forward(
        self,
        batch: dict[str, Tensor],
        batching: MicroBatching,
        temperature: float = 1.0,
        extras: tuple[str, ...] = (),
        record_routing: bool = False,
    ) -> dict[str, Tensor]:
        """`log_probs` and the `extras` (`logprobs.EXTRAS`: entropy, sum_pi_squared) `[b, r]` for a policy,
        `values` `[b, r]` for a critic.

        With routing replay enabled: a `routed_experts` column is replayed (and `routing_mismatch`/`routing_tokens`
        `[b]` count the token×layer pairs whose own top-k differed from it, and those with a record);
        `record_routing` returns the experts each router used as `routed_experts` `[b, s, moe_layers·k]` (replayed or
        its own; the j-th MoE layer's at [j·k, (j+1)·k), the layout `agents.postprocess` gives the engines' routing)."""
        for chunk in self.chunks:
            chunk.eval()
        micros = self._micros(batch, batching)
        factory = partial(self._loss_func, temperature=temperature, loss_fn=None, normalizer=None, extras=extras)
        self._recording = record_routing
        try:
            results = self._run(micros, forward_only=True, loss_factory=factory)
        finally:
            self._recording = False
        keys = ["values"] if self.model.value_head else ["log_probs", *extras]
        shape = batch["responses"].shape
        outputs = {key: torch.zeros(shape, dtype=torch.float32) for key in keys}
        for result in results:
            for key in keys:
                if len(result["rows"]):
                    outputs[key][result["rows"].cpu()] = result[key].float().cpu()
        for key in keys:
            outputs[key] = outputs[key] * batch["response_mask"].to(torch.float32)
            if self.groups.layout.pp > 1:
                outputs[key] = self._broadcast_from_last_stage(outputs[key])
        return outputs | self._routing_results(tuple(batch["input_ids"].shape))

    def _on_comm_device(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.device) if self.device is not None else tensor

    def _broadcast_from_last_stage(self, tensor: Tensor) -> Tensor:
        tensor = self._on_comm_device(tensor)
        dist.broadcast(tensor, src=self._last_stage_rank, group=self.groups.pgs.pp)
        return tensor.cpu()

    # ---- update ----

    def _normalizer(self, batch: dict[str, Tensor], norm_length: float | None) -> LossNormalizer:
        mask = batch["response_mask"].to(torch.float64)
        counts = self._on_comm_device(torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().to(torch.float64)]))
        dist.all_reduce(counts, group=self.groups.pgs.dp)
        length = norm_length if norm_length is not None else float(mask.shape[1])
        return LossNormalizer(num_tokens=float(counts[0]), num_seqs=float(counts[1]), norm_length=length)

    def train_step(
        self,
        batch: dict[str, Tensor],
        batching: MicroBatching,
        loss_fn: MicroBatchLoss,
        temperature: float = 1.0,
        norm_length: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this DP rank's share of a mini-batch; metrics reduced across DP.

        A non-finite loss or gradient on any rank of the role skips the step on all of them (weights, optimizer
        state and LR schedule untouched): then `skipped` is 1 and `grad_norm` NaN."""
        if self.trainable is None:
            raise RuntimeError("this engine was built without an optimizer (a reference model) and cannot train")
        for chunk in self.trainable.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.trainable.optimizer.zero_grad()
        normalizer = self._normalizer(batch, norm_length)
        micros = self._micros(batch, batching)
        factory = partial(self._loss_func, temperature=temperature, loss_fn=loss_fn, normalizer=normalizer, extras=())
        results = self._run(micros, forward_only=False, loss_factory=factory)
        routing = self._routing_results(tuple(batch["input_ids"].shape))
        finite = all_finite(self.trainable, [result["loss"] for result in results])
        grad_norm = self.trainable.optimizer.step()[1] if finite else float("nan")
        if finite:
            self.trainable.scheduler.step(increment=1)
        metrics = self._reduce_metrics(results)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["skipped"] = float(not finite)
        metrics["lr"] = float(self.trainable.optimizer.param_groups[0]["lr"])
        metrics |= self._token_metrics(micros)
        if routing:
            metrics |= self._mismatch_fraction(routing)
        return metrics

    def _mismatch_fraction(self, routing: dict[str, Tensor]) -> dict[str, float]:
        """`router_replay/mismatch_frac` of a replayed step: token×layer pairs whose own top-k differed from the
        replayed one, over those with a record, across DP."""
        totals = torch.stack([routing["routing_mismatch"].sum(), routing["routing_tokens"].sum()]).double()
        totals = self._on_comm_device(totals)
        dist.all_reduce(totals, group=self.groups.pgs.dp)
        return {"router_replay/mismatch_frac": float(totals[0] / totals[1].clamp(min=1.0))}

    def _token_metrics(self, micros: list[dict[str, Any]]) -> dict[str, float]:
        """`packing/*`: real and computed tokens of the step (all DP ranks), the padding's share, micro-batches per
        DP rank (fillers included)."""
        real, computed = (sum(m["tokens"][i] for m in micros) for i in (0, 1))
        totals = self._on_comm_device(torch.tensor([real, computed, len(micros)], dtype=torch.float64))
        dist.all_reduce(totals, group=self.groups.pgs.dp)
        return {
            "packing/real_tokens": float(totals[0]),
            "packing/computed_tokens": float(totals[1]),
            "packing/padding_frac": 1.0 - float(totals[0] / totals[1].clamp(min=1.0)),
            "packing/micro_batches_per_rank": float(totals[2]) / self.groups.layout.dp,
        }

    def _micros(self, batch: dict[str, Tensor], batching: MicroBatching) -> list[dict[str, Any]]:
        replay = self.routing is not None
        return [self.inputs.prepare(batch, rows, replay) for rows in self.inputs.split(batch, batching)]

    def _reduce_metrics(self, results: list[dict[str, Any]]) -> dict[str, float]:
        """Summed metrics add over micro-batches and DP; the rest average over the micro-batches with rows.
        Broadcast from the last stage."""
        results = [result for result in results if not result.pop("filler")]
        names = sorted(results[0]) if results else []
        names_list = [names]
        if self.groups.layout.pp > 1:
            dist.broadcast_object_list(names_list, src=self._last_stage_rank, group=self.groups.pgs.pp)
        names = names_list[0]
        values = torch.zeros(len(names) + 1, dtype=torch.float64)
        for result in results:
            for i, name in enumerate(names):
                values[i] += float(result[name])
        values[-1] = len(results)
        values = self._on_comm_device(values)
        dist.all_reduce(values, group=self.groups.pgs.dp)
        values = self._broadcast_from_last_stage(values) if self.groups.layout.pp > 1 else values.cpu()
        count = max(float(values[-1]), 1.0)
        return {
            name: float(values[i]) if name in SUMMED_METRICS else float(values[i]) / count
            for i, name in enumerate(names)
        }
