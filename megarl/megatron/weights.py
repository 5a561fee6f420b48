"""Load Hugging Face safetensors into a role's Megatron chunks through the weight plan."""

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from megatron.core.models.gpt import GPTModel

from megarl.megatron.model import ADAPTERS, BuiltModel
from megarl.megatron.parallel import RoleGroups
from megarl.models.param_mapping import ParamMapping
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import padded_vocab_size, weight_plan

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_NORM = re.compile(r"(norm\d?|ln_q)\.weight$")
"""Norm weights (a vision tower's `norm1`/`norm2` and patch merger's `ln_q` too), initialised to ones."""
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class SafetensorsReader:
    """Reads single tensors from a model directory's safetensors files (sharded or not)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: root / file for name, file in weight_map.items()}
        else:
            single = root / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {root}")
            with safe_open(str(single), framework="pt") as f:
                files = dict.fromkeys(f.keys(), single)
        self._files = files
        self._open = {path: safe_open(str(path), framework="pt") for path in set(files.values())}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header, without reading the data."""
        return tuple(self._open[self._files[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._open[self._files[name]].get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"{name} is not in the checkpoint's safetensors")
        return self._open[self._files[name]].get_tensor(name)


class HFTensors(Protocol):
    """What `load_hf_weights` reads from: HF tensors by name."""

    def get(self, name: str) -> torch.Tensor: ...


class SeededInit:
    """HF tensors drawn from (seed, name) alone, so a random init is the same under every layout.

    Megatron's own init is not: on GPU each TP rank draws its shard from its own CUDA RNG
    (tensor_parallel/random.py `model_parallel_cuda_manual_seed`); on CPU (`use_cpu_initialization`)
    full weights come from the torch RNG, whose stream every pipeline stage starts afresh. Here each
    tensor has its own CPU generator, seeded from a SHA-256 of the seed and the name, and is drawn at
    full size (float32); every rank takes its shard through the weight plan.

    The scheme is HF's (transformers modeling_utils.py `PreTrainedModel._init_weights`): RMSNorm
    weights (incl. q_norm/k_norm and a vision tower's norms) ones, biases zeros (incl. the routers'
    `e_score_correction_bias`, as modeling_glm4_moe.py `Glm4MoePreTrainedModel._init_weights`), everything else
    N(0, std²). `ModelSpec` does not carry the config's `initializer_range`; `std` defaults to 0.02, its value
    in every supported config and megatron's `init_method_std`. The draw is on CPU because a CUDA one depends on the GPU
    model (ATen cuda/DistributionTemplates.h `calc_execution_policy` sizes the grid by SM count).
    """

    def __init__(self, plan: dict[str, ParamMapping], seed: int, std: float = 0.02) -> None:
        self._shapes = {name: shape for m in plan.values() for name, shape in zip(m.hf_names, m.hf_shapes, strict=True)}
        self._seed = seed
        self._std = std

    def get(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(f"{name} is not in the model's weight plan")
        shape = self._shapes[name]
        if _NORM.search(name):
            return torch.ones(shape)
        if name.endswith((".bias", ".e_score_correction_bias")):
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{self._seed}/{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.empty(shape).normal_(0.0, self._std, generator=generator)


def model_plan(model: BuiltModel, groups: RoleGroups) -> dict[str, ParamMapping]:
    """The weight plan of `model` as built: padded to this role's TP, TE names when it uses TE."""
    vocab = padded_vocab_size(model.spec.vocab_size, groups.layout.tp)
    return weight_plan(model.spec, padded_vocab_size=vocab, te=model.options.use_te)


def named_weights(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A chunk's parameters but LoRA adapters (`chunk.lora`, `megarl.lora.model`), then the buffers the weight plan
    maps: each router's `expert_bias`, a persistent buffer that megarl keeps frozen (see
    `megarl.megatron.bridge.moe_config`)."""
    for name, param in chunk.named_parameters():
        if not name.startswith(f"{ADAPTERS}."):
            yield name, param
    for name, buffer in chunk.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buffer


def global_name(local: str, chunk: GPTModel, groups: RoleGroups, num_experts: int) -> str:
    """A chunk-local parameter name → its name in the full model (HF layer and expert numbering)."""
    match = _LAYER.match(local)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))].layer_number - 1
        local = f"decoder.layers.{layer}." + local[match.end() :]
    expert = _EXPERT.search(local)
    if expert:
        num_local = num_experts // groups.layout.ep
        index = groups.ep_rank * num_local + int(expert.group(1))
        local = local[: expert.start()] + f".local_experts.{index}." + local[expert.end() :]
    return local


def local_mapping(
    name: str, chunk: GPTModel, groups: RoleGroups, plan: dict[str, ParamMapping], spec: ModelSpec
) -> tuple[ParamMapping, int, int]:
    """A chunk parameter's mapping and this rank's (rank, size) in the group that splits it.

    With tied embeddings and PP>1 the last stage holds a copy of the embedding as output_layer.
    """
    full_name = global_name(name, chunk, groups, spec.num_experts)
    if full_name == "output_layer.weight" and spec.tie_word_embeddings:
        full_name = "embedding.word_embeddings.weight"
    mapping = plan.get(full_name)
    if mapping is None:
        raise KeyError(f"megatron parameter {name} ({full_name}) has no HF mapping")
    if mapping.tp_group == "etp":
        return mapping, groups.etp_rank, groups.layout.etp
    return mapping, groups.tp_rank, groups.layout.tp


@torch.no_grad()
def load_hf_weights(model: BuiltModel, groups: RoleGroups, reader: HFTensors) -> int:
    """Copy HF weights into every parameter (and mapped buffer) of the model's chunks; returns how many were filled.

    A critic's value head has no HF counterpart and keeps its zero initialisation.
    """
    spec = model.spec
    plan = model_plan(model, groups)
    filled = 0
    for chunk in model.chunks:
        for name, param in named_weights(chunk):
            if model.value_head and name == "output_layer.weight":
                continue
            mapping, rank, size = local_mapping(name, chunk, groups, plan, spec)
            full = mapping.merge([reader.get(n) for n in mapping.hf_names])
            shard = mapping.shard(full, rank, size)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{mapping.mcore_name}: HF gives {tuple(shard.shape)}, megatron expects {tuple(param.shape)}"
                )
            param.copy_(shard)
            filled += 1
    return filled


@torch.no_grad()
def gather_hf_weights(model: BuiltModel, groups: RoleGroups) -> dict[str, torch.Tensor]:
    """This rank's pipeline stage as full HF tensors: TP/ETP shards gathered, experts of this EP rank.

    Collective over the role's TP and expert-TP groups. Ranks of other stages (or EP ranks) hold
    the rest; a caller merges the dicts. A critic's value head is returned as `value_head.weight`.
    """
    spec = model.spec
    plan = model_plan(model, groups)
    out: dict[str, torch.Tensor] = {}
    for chunk in model.chunks:
        for name, param in named_weights(chunk):
            if model.value_head and name == "output_layer.weight":
                out["value_head.weight"] = param.detach().clone()
                continue
            mapping, _, size = local_mapping(name, chunk, groups, plan, spec)
            group = groups.pgs.expt_tp if mapping.tp_group == "etp" else groups.pgs.tp
            shards = [param.detach().clone()]
            if mapping.tp_dim is not None and size > 1:
                shards = [torch.empty_like(param) for _ in range(size)]
                torch.distributed.all_gather(shards, param.detach().contiguous(), group=group)
            for hf_name, tensor in zip(mapping.hf_names, mapping.split(mapping.unshard(shards)), strict=True):
                out[hf_name] = tensor.clone()
    return out
