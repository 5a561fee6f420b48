"""LoRA adapters in the embedded engine's model, each request's rows run with its own (SGLang's `--enable-lora`).

An adapter arrives as PEFT saves it: a LoraConfig dict (adapter_config.json) and full-size tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. `EngineAdapters.load` injects
peft's LoRA layers into the transformers model in place, under the adapter's name, on exactly the modules the
tensors name (peft/tuners/tuners_utils.py::BaseTuner.inject_adapter given a state_dict), then copies the tensors in
(peft/utils/save_and_load.py::set_peft_model_state_dict). Several adapters live side by side (old and new during
asynchronous training). Every forward names an adapter per batch row (`rows`; the base model's rows are
`__base__`) and each LoRA layer adds an adapter's update to that adapter's rows only
(peft/tuners/lora/layer.py::Linear._mixed_batch_forward, reached through the `adapter_names` argument that a
forward pre-hook passes, as peft's tuners/lora/model.py::LoraModel._enable_peft_forward_hooks does).
Base weights keep their HF names for weight updates and releases (`weights.base_name` looks through peft's wrapper).

Refused with ValueError (the load's `error_message`): a rank above `--max-lora-rank`, projections outside
`--lora-target-modules`, DoRA and `modules_to_save`, a name already loaded, and tensors of MoE experts
(`.experts.<e>.`): transformers 5 fuses each layer's experts into 3-D parameters (`mlp.experts.gate_up_proj`
[E, 2·I, H], see weights.py), so there is no per-expert Linear for peft to wrap.
"""

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer, LoraModel
from transformers import PreTrainedModel

from megarl.engines.embedded.weights import base_name

BASE = "__base__"
"""The adapter name of a row that runs the base model (peft's, tuners/lora/layer.py::Linear._mixed_batch_forward)."""
ALL_TARGETS = "all"
"""`--lora-target-modules all`: any projection (SGLang's LORA_TARGET_ALL_MODULES)."""
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""SGLang's fused target names and the HF projections each stands for (lora/utils.py::get_normalized_target_modules)."""
PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.weight)?$")
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """What adapters an engine takes: `--max-lora-rank` and `--lora-target-modules`."""

    max_rank: int
    target_modules: tuple[str, ...]
    """HF projection names (SGLang's qkv_proj and gate_up_proj stand for theirs), or ("all",)."""

    def allowed(self) -> set[str] | None:
        """The projection names adapters may target; None = any."""
        if ALL_TARGETS in self.target_modules:
            return None
        return {part for name in self.target_modules for part in FUSED_TARGETS.get(name, (name,))}


class EngineAdapters:
    """The adapters loaded into `model`; call every method on the engine thread (between forwards)."""

    def __init__(self, model: PreTrainedModel, limits: LoraLimits) -> None:
        self.model = model
        self.limits = limits
        self._tuner: LoraModel | None = None
        """peft's tuner over `model` (the model itself is changed in place); None before the first adapter."""
        self._rows: list[str] | None = None
        self._hooked: set[int] = set()

    @property
    def names(self) -> list[str]:
        return [] if self._tuner is None else sorted(self._tuner.peft_config)

    def load(self, name: str, config_dict: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Add adapter `name` (PEFT's config dict and tensor names); ValueError, changing nothing, if refused."""
        config = _lora_config(name, config_dict)
        keys = {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}
        self._check(name, config, keys)
        try:
            self._inject(name, config, keys)
            _fill(self.model, name, keys)
        except (RuntimeError, ValueError) as e:
            self._forget(name)
            raise ValueError(f"LoRA adapter {name}: {e}") from e
        self._hook_layers()
        self.model.eval()  # the new layers' dropout

    def unload(self, name: str) -> None:
        """Remove adapter `name` from every layer."""
        assert self._tuner is not None and name in self._tuner.peft_config, name
        with warnings.catch_warnings():  # "Adapter x was active ... now deleted": rows pick adapters, none is active
            warnings.simplefilter("ignore", UserWarning)
            self._tuner.delete_adapter(name)

    @contextlib.contextmanager
    def rows(self, names: list[str | None]) -> Iterator[None]:
        """Within the block, forward row i with adapter `names[i]` (None = the base model)."""
        self._rows = [name or BASE for name in names]
        try:
            yield
        finally:
            self._rows = None

    def _check(self, name: str, config: LoraConfig, keys: dict[str, torch.Tensor]) -> None:
        if not name or "." in name or name == BASE:
            raise ValueError(f"LoRA adapter name {name!r}: use a non-empty name without '.', not {BASE!r}")
        if name in self.names:  # SGLang's words (lora_manager.py::validate_new_adapter)
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if config.use_dora or config.modules_to_save:
            raise ValueError(f"Failed to load {name}: the embedded engine takes no DoRA or modules_to_save")
        rank = max([config.r, *(config.rank_pattern or {}).values()])
        if rank > self.limits.max_rank:
            raise ValueError(f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.limits.max_rank}")
        _check_modules(name, self.model, keys, self.limits.allowed())

    def _inject(self, name: str, config: LoraConfig, keys: dict[str, torch.Tensor]) -> None:
        if self._tuner is None:
            self._tuner = LoraModel(self.model, config, name, state_dict=keys)
            return
        self._tuner.peft_config[name] = config
        self._tuner.inject_adapter(self.model, name, state_dict=keys)

    def _forget(self, name: str) -> None:
        """Undo a load that failed part way."""
        if self._tuner is not None and name in self._tuner.peft_config:
            with contextlib.suppress(ValueError):  # no layer got it
                self.unload(name)
            self._tuner.peft_config.pop(name, None)

    def _hook_layers(self) -> None:
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and id(module) not in self._hooked:
                module.register_forward_pre_hook(self._name_rows, with_kwargs=True)
                self._hooked.add(id(module))

    def _name_rows(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A LoRA layer's `adapter_names`: each row's adapter, repeated where the layer sees the batch flattened to
        tokens ([b·s, h], e.g. a MoE block's shared expert); all base outside `rows`."""
        count = len(args[0] if args else kwargs["x"])
        rows = self._rows or [BASE]
        assert count % len(rows) == 0, f"a LoRA layer got {count} rows for {len(rows)} sequences"
        kwargs["adapter_names"] = [row for row in rows for _ in range(count // len(rows))]
        return args, kwargs


def _lora_config(name: str, config_dict: dict[str, Any]) -> LoraConfig:
    try:
        config = LoraConfig.from_peft_type(**config_dict)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name}: config_dict is not a PEFT LoraConfig: {e!r}") from e
    if not isinstance(config, LoraConfig):
        raise ValueError(f"LoRA adapter {name}: peft_type {config.peft_type} is not LORA")
    return config


def _check_modules(name: str, model: PreTrainedModel, keys: dict[str, torch.Tensor], allowed: set[str] | None) -> None:
    """Every tensor is a LoRA factor of a module the model has, no MoE expert's, within `allowed` projections."""
    if not keys:
        raise ValueError(f"LoRA adapter {name} has no tensors")
    modules = set()
    for key in keys:
        if _EXPERT.search(key):
            raise ValueError(
                f"LoRA adapter {name} targets MoE experts ({PEFT_PREFIX}{key}): the embedded engine cannot serve them, "
                "transformers 5 fuses each layer's experts into 3-D parameters that peft's LoRA layers cannot wrap"
            )
        match = _TENSOR.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name}: {PEFT_PREFIX}{key} is not a PEFT lora_A/lora_B tensor name")
        modules.add(match["module"])
    if missing := sorted(m for m in modules if not _has_module(model, m)):
        raise ValueError(f"LoRA adapter {name} names modules the model lacks: {missing[:3]}")
    if allowed is not None and (outside := sorted({m.rsplit(".", 1)[-1] for m in modules} - allowed)):
        raise ValueError(f"LoRA adapter {name} targets {outside}, outside --lora-target-modules {sorted(allowed)}")


def _has_module(model: PreTrainedModel, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _fill(model: PreTrainedModel, name: str, keys: dict[str, torch.Tensor]) -> None:
    """Copy the adapter's tensors into its freshly injected factors; every factor must be given."""
    result: Any = set_peft_model_state_dict(model, keys, adapter_name=name)  # torch's _IncompatibleKeys
    if result.unexpected_keys:
        raise ValueError(f"tensors the model has no place for: {sorted(result.unexpected_keys)[:3]}")
    if missing := sorted(k for k in result.missing_keys if base_name(k) is None and name in k.split(".")):
        raise ValueError(f"missing tensors: {missing[:3]}")
