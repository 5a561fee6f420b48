"""The embedded engine's weights: load by name, release to free memory, restore."""

import ctypes
import gc
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

_EXPERT = re.compile(
    r"^(?P<layer>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_GATE_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
_VL_LAYOUT = "model.language_model.embed_tokens.weight"
"""Present in a vision-language model as transformers 5 holds it (`model.language_model.*`, `model.visual.*`)."""
_VL_RENAMES = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."),
)
"""Checkpoint (and SGLang) names of Qwen2-VL-style models → in-memory ones: the renamings transformers applies when
loading (conversion_mapping.py, "Qwen2VLForConditionalGeneration": `visual` → `model.visual`, `model.*` →
`model.language_model.*`; `lm_head` unchanged)."""
_ADAPTER_WEIGHT = re.compile(r"\.lora_[A-Za-z_]+\.")
"""Names of LoRA adapters' own tensors (peft's `lora_A.<adapter>.weight`, `lora_embedding_B.<adapter>`, ...:
tuners/lora/layer.py::LoraLayer.adapter_layer_names)."""


def base_name(name: str) -> str | None:
    """The HF name of a model tensor, peft's LoRA wrapper (`q_proj.base_layer.weight`) looked through; None for an
    adapter's own tensor (megarl/engines/embedded/lora.py injects them; weight updates and releases skip them)."""
    return None if _ADAPTER_WEIGHT.search(name) else name.replace(".base_layer.", ".")


def named_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """HF name → parameter or buffer (tied weights appear under each of their names); no LoRA adapter tensors."""
    return {hf: t for name, t in model.state_dict(keep_vars=True).items() if (hf := base_name(name)) is not None}


def base_parameters(model: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    """HF name → parameter, LoRA adapters' own left out (they keep their values across a release)."""
    return {hf: p for name, p in model.named_parameters() if (hf := base_name(name)) is not None}


@torch.no_grad()
def keep_fp32(model: PreTrainedModel) -> None:
    """Upcast to fp32 the weights a half-precision model keeps in fp32 (`_keep_in_fp32_modules_strict`, e.g. the
    routers' `e_score_correction_bias`), as `from_pretrained` does (modeling_utils.py::PreTrainedModel._get_dtype_plan)
    and SGLang does (srt/models/deepseek_v2.py::MoEGate.__init__). `from_config` alone leaves those made in the
    default dtype in the model's (5.23's modeling_deepseek_v3.py::DeepseekV3TopkRouter)."""
    patterns = model._keep_in_fp32_modules_strict or ()
    for name, tensor in named_weights(model).items():
        if any(pattern in name for pattern in patterns):
            tensor.data = tensor.data.float()


def weight_slot(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor (or view) a checkpoint-format name fills; KeyError if the model has none. A vision-language
    model takes its checkpoint names (`visual.*`, `model.layers.*`) as well as its in-memory ones.

    Checkpoints (and SGLang) name experts one by one (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.w1.weight`); transformers holds them fused per layer:
    `mlp.experts.gate_up_proj` [E, 2·I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
    """
    name = _in_memory_name(weights, name)
    if name in weights:
        return weights[name].data
    expert = _EXPERT.match(name)
    if expert:
        layer, e, proj = expert["layer"], int(expert["e"]), expert["proj"]
        if proj in _GATE_HALF:
            fused = weights[f"{layer}mlp.experts.gate_up_proj"].data[e]
            return fused.chunk(2, dim=0)[_GATE_HALF[proj]]
        return weights[f"{layer}mlp.experts.down_proj"].data[e]
    renamed = name.replace(".block_sparse_moe.", ".mlp.")
    if renamed != name:
        return weights[renamed].data
    raise KeyError(name)


def _in_memory_name(weights: dict[str, torch.Tensor], name: str) -> str:
    """`name` as a vision-language model holds it in memory (`_VL_RENAMES`); unchanged for other models."""
    if name in weights or _VL_LAYOUT not in weights:
        return name
    for pattern, replacement in _VL_RENAMES:
        name = pattern.sub(replacement, name)
    return name


def check_names(model: PreTrainedModel, names: list[str], shapes: list[list[int]] | None = None) -> None:
    """ValueError naming the first unknown name or wrong shape."""
    weights = named_weights(model)
    for i, name in enumerate(names):
        try:
            slot = weight_slot(weights, name)
        except KeyError:
            raise ValueError(
                f"unknown weight {name!r}; the engine's names are HF names like {next(iter(weights))!r}"
            ) from None
        if shapes is not None and list(slot.shape) != list(shapes[i]):
            raise ValueError(f"weight {name}: shape {list(shapes[i])} sent, the model has {list(slot.shape)}")


@torch.no_grad()
def load_named(model: PreTrainedModel, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into the weight of that name (cast to the engine's dtype and device)."""
    check_names(model, [n for n, _ in named], [list(t.shape) for _, t in named])
    weights = named_weights(model)
    for name, tensor in named:
        weight_slot(weights, name).copy_(tensor)
    if any(t.is_cuda for _, t in named):
        torch.cuda.synchronize()  # the sender may reuse its buffers once we answer


def read_weight(model: PreTrainedModel, name: str, rows: int) -> list:
    """The first `rows` rows of the weight `name`, cast to fp32, as nested lists (ValueError if unknown)."""
    check_names(model, [name])
    return weight_slot(named_weights(model), name).to("cpu", torch.float32).tolist()[:rows]


@dataclass(kw_only=True, slots=True)
class ReleasedWeights:
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    backup: Path | dict[str, torch.Tensor] | None
    """A file (CPU engine), host copies (CUDA engine), or None: values are lost (a weight sync follows)."""


@torch.no_grad()
def release_weights(model: PreTrainedModel, backup: bool) -> ReleasedWeights:
    """Drop every parameter's storage; keep a backup on disk (CPU engine) or host memory (CUDA) if asked.

    Reference counting frees the storages here; the caller hands the memory back with one `free_memory` per
    release, whatever it released."""
    params = base_parameters(model)
    device = next(iter(params.values())).device
    saved: Path | dict[str, torch.Tensor] | None = None
    if backup and device.type == "cpu":
        saved = Path(tempfile.mkstemp(prefix="megarl_weights_", suffix=".pt")[1])
        torch.save({n: p.data for n, p in params.items()}, saved)
    elif backup:
        saved = {n: p.data.to("cpu") for n, p in params.items()}
    released = ReleasedWeights(shapes={n: (p.shape, p.dtype) for n, p in params.items()}, backup=saved)
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype, device=device)
    return released


@torch.no_grad()
def restore_weights(model: PreTrainedModel, released: ReleasedWeights, device: torch.device) -> None:
    """Re-allocate the parameters; fill them from the backup, or with zeros without one."""
    values: dict[str, torch.Tensor] = {}
    if isinstance(released.backup, Path):
        values = torch.load(released.backup, map_location=device, weights_only=True)
        released.backup.unlink()
    elif isinstance(released.backup, dict):
        values = released.backup
    for name, p in base_parameters(model).items():
        shape, dtype = released.shapes[name]
        p.data = values[name].to(device) if name in values else torch.zeros(shape, dtype=dtype, device=device)


def free_memory(device: torch.device) -> None:
    """Return freed memory to the system: CUDA's caching allocator, or glibc's heap on CPU.

    The collection only finds what reference counting cannot free (cycles); it walks only the objects made
    since `freeze_startup_objects`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        return


def freeze_startup_objects() -> int:
    """Once loaded and warmed up: collect, then move every object alive (modules, classes, the model) out of
    reach of later collections, which then walk only what serving made since; how many objects were frozen.

    SGLang does the same after its server warm-up (`entrypoints/http_server.py::_freeze_gc_after_server_warmup`
    → `utils/common.py::freeze_gc`, `gc.freeze()`). Without it a release's `gc.collect()` walked the whole
    torch + transformers heap (~360k objects: 0.2 s on an idle core, up to 1.7 s on 2 busy ones)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
