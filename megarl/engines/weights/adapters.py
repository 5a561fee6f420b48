"""LoRA adapters into engines: PEFT's config dict and tensors, passed by handle to `/load_lora_adapter_from_tensors`.

    await load_adapter(fleet, "megarl-lora-v3", config_dict, named, num_ranks=1)   # every replica of the fleet
    fleet.wait(load_adapter(fleet, "megarl-lora-v3", config_dict, named))           # from synchronous code

`named` are the adapter's full-size tensors under PEFT's names (`base_model.model.<module>.lora_A.weight` [r, in],
`.lora_B.weight` [out, r]), and `config_dict` its adapter_config.json (JSON-able). Handles open on the engine's node
only: CPU tensors move into named shared memory, CUDA tensors go by IPC; they must stay alive until the call returns.
"""

from typing import Any

import torch

from megarl.engines.client.fleet import Fleet
from megarl.engines.weights.tensor_handles import serialize_tensor_dict


def adapter_entries(named: list[tuple[str, torch.Tensor]], num_ranks: int = 1) -> list[str]:
    """One engine's `serialized_named_tensors`: an entry per TP rank (SGLang's tp_size; 1 for the embedded engine),
    each serialized on its own, as each receiving rank consumes the shared-memory reference its entry adds."""
    return [serialize_tensor_dict(dict(named)) for _ in range(num_ranks)]


async def load_adapter(
    fleet: Fleet,
    lora_name: str,
    config_dict: dict[str, Any],
    named: list[tuple[str, torch.Tensor]],
    num_ranks: int = 1,
) -> None:
    """Every replica of `fleet` loads LoRA adapter `lora_name`, so /generate calls may name it in `lora_path`."""
    await fleet.each(
        lambda c: c.load_lora_adapter_from_tensors(lora_name, config_dict, adapter_entries(named, num_ranks))
    )
