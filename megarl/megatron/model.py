"""Build one role's megatron-core GPTModel chunks (one per virtual pipeline stage) on its groups."""

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megarl.megatron.bridge import BuildOptions, block_spec, gpt_model_kwargs, transformer_config
from megarl.megatron.mrope import use_mrope
from megarl.megatron.parallel import RoleGroups
from megarl.megatron.vision import FROZEN_TOWER, VisionTraining, attach_vision_tower
from megarl.models.spec import ModelSpec

ADAPTERS = "lora"
"""The attribute of each chunk holding its LoRA adapters (`megarl.lora.model.LoraLayers`), their names' prefix."""


class ValueHead(torch.nn.Module):
    """Critic head in place of GPTModel's output layer: hidden [s, b, h] → values [s, b, 1].

    Replicated across TP; under sequence parallelism the sequence shards are gathered first.
    Its weight is marked `sequence_parallel` there so finalize_model_grads all-reduces it.
    """

    def __init__(self, config: TransformerConfig, tp_group: torch.distributed.ProcessGroup) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        if self.sequence_parallel:
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor, weight: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=self.tp_group)
        return torch.nn.functional.linear(hidden, self.weight), None


def last_token_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The engine inputs under which a value model's `values[:, 0]` is its head's output at each row's last real
    token: rows `[b, L]` left-padded (a sequence classifier's input, `megarl.convert.classifier`) as the prompt, one
    dummy response token (pad id 0) after them.

    The engine reads response token j's value from the position that predicts it (`megarl.megatron.packing`
    `align_left`/`pack`: `logit_index`), so token 0's is the prompt's last, here the row's last real token;
    causal attention keeps the dummy from changing it.
    """
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("rows to score must be left-padded: their last column must be a real token in every row")
    ones = attention_mask.new_ones(len(attention_mask), 1)
    dummy = input_ids.new_zeros(len(input_ids), 1)
    return {
        "input_ids": torch.cat([input_ids, dummy], dim=1),
        "attention_mask": torch.cat([attention_mask, ones], dim=1),
        "responses": dummy,
        "response_mask": ones,
    }


@torch.no_grad()
def load_value_head(model: "BuiltModel", weight: torch.Tensor) -> None:
    """Copy `weight` `[1, h]` (an HF sequence classifier's `score.weight`) into the value head of the last stage's
    chunk; other stages hold none."""
    assert model.value_head, "only a model built with value_head=True has a value head"
    for chunk in model.chunks:
        if not chunk.post_process:
            continue
        head = chunk.output_layer.weight
        if weight.shape != head.shape:
            raise ValueError(f"a value head is {tuple(head.shape)}, got {tuple(weight.shape)}")
        head.copy_(weight)


@dataclass(frozen=True, slots=True)
class BuiltModel:
    spec: ModelSpec
    options: BuildOptions
    config: TransformerConfig
    chunks: list[GPTModel]
    value_head: bool
    adapters: tuple[torch.nn.Module, ...] = ()
    """Per chunk, its LoRA adapters (`megarl.lora.model.LoraLayers`, also `chunk.lora`); empty without LoRA."""


def use_transformer_engine(impl: str, on_gpu: bool) -> bool:
    """Whether a role built with `transformer_impl=impl` gets TransformerEngine layers (and TE weight names)."""
    available = importlib.util.find_spec("transformer_engine") is not None
    if impl == "transformer_engine" and not (on_gpu and available):
        missing = "a GPU" if not on_gpu else "transformer_engine (pip install -e .[gpu])"
        raise ValueError(f"transformer_impl=transformer_engine needs {missing}; set transformer_impl=local or auto")
    return impl == "transformer_engine" or (impl == "auto" and on_gpu and available)


def build_options(groups: RoleGroups, params_dtype: torch.dtype, use_te: bool) -> BuildOptions:
    layout = groups.layout
    return BuildOptions(
        layout=layout,
        params_dtype=params_dtype,
        use_te=use_te,
        # Under PP megatron refuses allgather (transformer_config.py: no variable_seq_lengths). Otherwise CPU keeps
        # allgather: alltoall under expert TP all-gathers uneven splits, which gloo refuses.
        moe_token_dispatcher="alltoall" if torch.cuda.is_available() or layout.pp > 1 else "allgather",
    )


def build_model(
    spec: ModelSpec,
    groups: RoleGroups,
    params_dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    use_te: bool = False,
    seed: int = 1234,
    vision_training: VisionTraining = FROZEN_TOWER,
) -> BuiltModel:
    """GPTModel chunks of this rank's pipeline stage(s); `value_head` swaps the LM head for a scalar. A
    vision-language model's first stage also holds the vision tower (`chunk.vision`), trained as `vision_training`
    says (by default frozen)."""
    opts = build_options(groups, params_dtype, use_te)
    config = transformer_config(spec, opts)
    model_parallel_cuda_manual_seed(
        seed, tp_rank=groups.tp_rank, ep_rank=groups.ep_rank, etp_rank=groups.etp_rank, force_reset_rng=True
    )
    num_chunks = opts.layout.vpp or 1
    kwargs = gpt_model_kwargs(spec, opts)
    if value_head:
        kwargs["share_embeddings_and_output_weights"] = False
    chunks = []
    for vp_stage in range(num_chunks):
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(
                spec, config, opts.use_te, vp_stage if opts.layout.vpp else None, groups.pp_rank
            ),
            pre_process=groups.is_first_stage and vp_stage == 0,
            post_process=groups.is_last_stage and vp_stage == num_chunks - 1,
            pg_collection=groups.pgs,
            vp_stage=vp_stage if opts.layout.vpp else None,
            **kwargs,
        )
        if value_head and model.post_process:
            model.output_layer = ValueHead(config, groups.pgs.tp)
        if spec.vision is not None:
            use_mrope(model, spec.vision.family_facts.interleaved_mrope)
        if spec.vision is not None and model.pre_process:
            attach_vision_tower(model, spec.vision, params_dtype, vision_training)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return BuiltModel(spec=spec, options=opts, config=config, chunks=chunks, value_head=value_head)
