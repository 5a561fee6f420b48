"""A block-wise fp8 checkpoint (DeepSeek-V3's layout: float8_e4m3fn weights, a float32 `weight_scale_inv` per 128×128
block, `quantization_config` in config.json) is refused by name by the plan gate and by `megarl-convert`."""

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from megarl.assets import asset_path
from megarl.config.layout import ConfigError
from megarl.convert.stream import ConversionError, hf_to_mcore, mcore_to_hf
from megarl.models.quantized import quantization_problem
from megarl.plan.gate import validate

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK] * 2}


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and its per-block `weight_scale_inv` (weight ≈ fp8 · scale_inv, block by block)."""
    rows, cols = (-(-size // BLOCK) for size in weight.shape)
    scale_inv = torch.empty(rows, cols)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scale_inv[i, j] = block.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            quantized[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = block / scale_inv[i, j]
    return quantized, scale_inv


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny dense model as an unquantised checkpoint and as its block-wise fp8 version."""
    root = tmp_path_factory.mktemp("fp8")
    plain, fp8 = root / "bf16", root / "fp8"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(asset_path("models/tiny_dense"))).save_pretrained(plain)
    tensors = {}
    for name, tensor in AutoModelForCausalLM.from_pretrained(plain).state_dict().items():
        if name.endswith("proj.weight"):
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = _quantize(tensor)
        else:
            tensors[name] = tensor.contiguous()
    fp8.mkdir()
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text()) | {"quantization_config": FP8_CONFIG}
    (fp8 / "config.json").write_text(json.dumps(config))
    return plain, fp8


def _named(message: str, fp8: Path) -> None:
    assert f"{fp8 / 'config.json'} has quantization_config.quant_method='fp8'" in message, message
    assert "weight_block_size [128, 128]" in message and "fp8_cast_bf16.py" in message, message


def test_only_a_quantization_config_is_a_problem(checkpoints: tuple[Path, Path]) -> None:
    plain, fp8 = checkpoints
    assert quantization_problem(plain) is None
    problem = quantization_problem(fp8)
    assert problem is not None
    _named(problem, fp8)


@pytest.mark.parametrize("field", ["model.path", "critic.model_path"])
def test_the_gate_refuses_it_before_anything_starts(
    checkpoints: tuple[Path, Path], data_overrides: list[str], field: str
) -> None:
    plain, fp8 = checkpoints
    paths = {"model.path": plain, "critic.model_path": plain} | {field: fp8}
    overrides = [f"{name}={path}" for name, path in paths.items()]
    cfg = compose_config("model=tiny_dense", "model.random_init=false", "algorithm=ppo", *overrides, *data_overrides)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert f"{field}: {fp8 / 'config.json'}" in str(refused.value), refused.value
    _named(str(refused.value), fp8)


def test_the_unquantised_checkpoint_passes_the_gate(checkpoints: tuple[Path, Path], data_overrides: list[str]) -> None:
    plain = checkpoints[0]
    validate(compose_config("model=tiny_dense", "model.random_init=false", f"model.path={plain}", *data_overrides))


def test_convert_refuses_it_both_ways(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    fp8 = checkpoints[1]
    with pytest.raises(ConversionError) as to_mcore:
        hf_to_mcore(fp8, tmp_path / "mcore")
    _named(str(to_mcore.value), fp8)
    assert not (tmp_path / "mcore").exists()
    mcore = tmp_path / "stored"
    mcore.mkdir()
    (mcore / "metadata.json").write_text("{}")
    with pytest.raises(ConversionError) as to_hf:  # bf16 tensors under an fp8 config.json would be a broken model
        mcore_to_hf(mcore, fp8, tmp_path / "hf")
    _named(str(to_hf.value), fp8)
