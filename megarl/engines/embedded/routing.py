"""Routed-experts capture (R3): the top-k experts each MoE layer's router picks for every token the engine forwards.

SGLang (`srt/state_capturer/routed_experts.py::RoutedExpertsCapturer`, `srt/state_capturer/base.py`) writes
each MoE layer's top-k ids into a [tokens, num_hidden_layers, top_k] int32 buffer, leaves dense layers' columns
0, and files the rows by KV slot, so a prefix-cache hit returns the routing of the forward that computed the
prefix. Here a forward hook on each transformers router module does the capture: the five supported families
(qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3) route through one module class per model, the one
their `_can_record_outputs["router_logits"]` names (e.g. `modeling_qwen3_moe.py::Qwen3MoeTopKRouter`), whose
forward returns (router_logits, weights, top-k ids [tokens, top_k]) for the flattened [batch * seq] tokens.
Before transformers 5.19, glm4_moe and deepseek_v3 do not list "router_logits" there (5.17's
`modeling_deepseek_v3.py::DeepseekV3PreTrainedModel._can_record_outputs` has hidden_states and attentions only),
though their routers already return that same tuple (5.17's `DeepseekV3TopkRouter.forward`,
`modeling_glm4_moe.py::Glm4MoeTopkRouter.forward`): `FALLBACK_ROUTERS` names those classes.
"""

import base64
from typing import Any

import torch
from transformers import PreTrainedModel

ROUTER_OUTPUT_INDICES = 2
"""Where the top-k ids sit in a router's output tuple (e.g. modeling_deepseek_v3.py::DeepseekV3TopkRouter)."""
FALLBACK_ROUTERS = {"glm4_moe": "Glm4MoeTopkRouter", "deepseek_v3": "DeepseekV3TopkRouter"}
"""model_type → its router's class name, for the transformers versions whose `_can_record_outputs` lacks it."""


class RoutingRecorder:
    """Hooks every router of `model`; `take` returns what the last forward picked, per token and layer."""

    def __init__(self, model: PreTrainedModel) -> None:
        routers = router_modules(model)
        self.num_layers = int(model.config.num_hidden_layers)
        self.top_k = int(model.config.num_experts_per_tok)
        self._picked: dict[int, torch.Tensor] = {}
        """Layer index → the top-k ids [tokens, top_k] its router picked in the latest forward."""
        for layer, router in routers.items():
            router.register_forward_hook(self._hook(layer))
        self.moe_layers = sorted(routers)

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            self._picked[layer] = output[ROUTER_OUTPUT_INDICES]

        return record

    def take(self, batch: int, seq_len: int) -> torch.Tensor:
        """The latest forward's routing, int32 [batch, seq_len, num_layers, top_k] on the CPU (dense layers 0)."""
        picked = torch.zeros(batch * seq_len, self.num_layers, self.top_k, dtype=torch.int32)
        for layer in self.moe_layers:
            ids = self._picked.pop(layer)
            assert ids.shape == (batch * seq_len, self.top_k), f"layer {layer} routed {tuple(ids.shape)}"
            picked[:, layer] = ids.to("cpu", torch.int32)
        return picked.view(batch, seq_len, self.num_layers, self.top_k)


def router_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """Decoder layer index → its MoE router module; layers without one (dense MLPs) are absent."""
    class_name = router_class_name(model)
    if class_name is None or not hasattr(model.config, "num_experts_per_tok"):
        raise ValueError(
            f"--enable-return-routed-experts needs a transformers MoE model; {model.config.model_type} has no router"
        )
    routers = {}
    for index, layer in enumerate(model.get_decoder().layers):
        found = [m for m in layer.modules() if type(m).__name__ == class_name]
        assert len(found) <= 1, f"decoder layer {index} has {len(found)} routers"
        if found:
            routers[index] = found[0]
    return routers


def router_class_name(model: PreTrainedModel) -> str | None:
    """The class name of `model`'s router modules: the one `_can_record_outputs["router_logits"]` records, else
    the family's entry in `FALLBACK_ROUTERS`; None for a model without one."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is not None:  # target_class may be a class or its name (modeling_utils.py::can_record_outputs)
        target = recorder.target_class
        return target if isinstance(target, str) else str(target.__name__)
    return FALLBACK_ROUTERS.get(model.config.model_type)


def encode(routing: torch.Tensor) -> str:
    """`meta_info.routed_experts`: base64 of the int32 [rows, layers, top_k] array's bytes, as
    detokenizer_manager.py::_b64_encode_per_request encodes it."""
    return base64.b64encode(routing.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")
