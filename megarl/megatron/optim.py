"""DDP wrapping, the (distributed) optimizer and its LR schedule for one trainable role."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from megarl.config.training import OPTIMIZER_NAMES, OptimConfig
from megarl.megatron.model import BuiltModel
from megarl.megatron.parallel import RoleGroups


@dataclass(slots=True)
class Trainable:
    chunks: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler


def make_trainable(
    model: BuiltModel, groups: RoleGroups, optim: OptimConfig, use_distributed_optimizer: bool, total_steps: int
) -> Trainable:
    """Wrap the chunks in megatron DDP and build optimizer + scheduler.

    Losses are normalised by counts summed over the whole mini-batch and DP group, so megatron is
    told to sum (not average) gradients: `calculate_per_token_loss`.
    """
    if optim.name not in OPTIMIZER_NAMES:
        raise ValueError(f"optim.name={optim.name!r} is unknown; choose one of {OPTIMIZER_NAMES}")
    config = model.config
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, pg_collection=groups.pgs)
        for chunk in model.chunks
    ]
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    config.finalize_model_grads_func = _finalize_grads_unscaled
    opt_config = OptimizerConfig(
        optimizer=optim.name,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=config.params_dtype == torch.bfloat16,
        fp16=config.params_dtype == torch.float16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks, use_gloo_process_groups=False, pg_collection=groups.pgs)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=max(total_steps, optim.lr_warmup_steps + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return Trainable(chunks=chunks, optimizer=optimizer, scheduler=scheduler)


def all_finite(trainable: Trainable, losses: list[torch.Tensor]) -> bool:
    """Whether every gradient in this rank's DDP buffers and every loss in `losses` is finite, on every rank of the
    role: one answer on all of them (a MIN over the role's torch.distributed world, which only this role uses), so
    they all step or all skip. Call after the backward passes (and their DP reduction), before the optimizer step.

    megatron-core's optimizers check the gradients only with fp16's loss scaler (an overflow skips the step there
    and lowers the scale, so under fp16 only the losses are checked here); the fp32 and bf16 ones step on NaN
    gradients (a NaN norm fails the clip test `max_norm / norm < 1`), and DDP's `check_for_nan_in_grad` raises
    instead of skipping. A NaN anywhere is in some rank's buffer: the reduced shard of the distributed
    optimizer's owner, or the local part of the rank it came from. Sums, not masks the size of the buffers: a
    sum is not finite when an element is not, or when the gradients are beyond fp32's range (their norm too)."""
    buffers = [buffer for chunk in trainable.chunks for buffer in chunk.buffers + chunk.expert_parallel_buffers]
    device = buffers[0].grad_data.device
    grads = [] if trainable.optimizer.config.fp16 else [buffer.grad_data for buffer in buffers]
    total = sum((tensor.float().sum().to(device) for tensor in grads + losses), torch.zeros((), device=device))
    flag = torch.isfinite(total).float().reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _finalize_grads_unscaled(model: list[torch.nn.Module], num_tokens: torch.Tensor | None, **kwargs: Any) -> None:
    """finalize_model_grads without its division by the token count: megarl's losses are already
    normalised by the mini-batch-wide counts (LossNormalizer), so the schedule's count must not apply.

    Nor its expert-bias update: the routers' `expert_bias` (HF `e_score_correction_bias`) stays frozen
    (`megarl.megatron.bridge.moe_config`), and megatron's update (finalize_model_grads.py
    `_update_router_expert_bias`) reduces over parallel_state's global groups, which megarl does not build.
    """
    config = get_model_config(model[0])
    expert_bias = config.moe_router_enable_expert_bias
    config.moe_router_enable_expert_bias = False
    try:
        finalize_model_grads(model, None, **kwargs)
    finally:
        config.moe_router_enable_expert_bias = expert_bias


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside a DDP wrapper (or the model itself)."""
    while isinstance(chunk, DistributedDataParallel):
        chunk = chunk.module
    assert isinstance(chunk, GPTModel)
    return chunk
