"""Quantised HF checkpoints are refused by name, before anything loads them.

A checkpoint whose config.json has a `quantization_config` stores low-precision weights with their scales beside
them (DeepSeek-V3's release: `quant_method: fp8`, `weight_block_size: [128, 128]`, one `<name>.weight_scale_inv`
per 128×128 block of a float8_e4m3fn weight). megarl's Megatron loader (`megarl.megatron.weights.SafetensorsReader`)
reads plain float tensors, and a weight push sends the trainer's unquantised tensors, which nothing in megarl
re-quantises for an engine serving the fp8 checkpoint. So the plan gate (`megarl.plan.gate`, for every checkpoint
a Megatron role loads) and `megarl-convert` (`megarl.convert.stream.spec_of`) refuse it with the fix: dequantise
first, as NeMo's DeepSeek-V3 guide does (the model's own inference/fp8_cast_bf16.py, then config.json without
`quantization_config`).
"""

import json
from pathlib import Path


def quantization_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` cannot be loaded as it is, naming its config.json and quant_method; None when its config.json
    has no `quantization_config` (or there is no config.json: other checks report that)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
    if not quantization:
        return None
    method = quantization.get("quant_method")
    blocks = f" (weight_block_size {quantization['weight_block_size']})" if "weight_block_size" in quantization else ""
    return (
        f"{config_file} has quantization_config.quant_method={method!r}{blocks}: megarl loads and pushes unquantised "
        "weights; dequantise the checkpoint to bf16 first (fp8 DeepSeek-V3 family: the model's own "
        "inference/fp8_cast_bf16.py), copy config.json there without quantization_config, and point at that directory"
    )
