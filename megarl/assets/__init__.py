"""Files shipped with the package: the tokenizer and the tiny model configs.

Layout::

    assets/tokenizer/          byte-level BPE tokenizer + chat template (tools/build_tokenizer.py)
    assets/models/tiny_dense/  Qwen2-style HF config, random init
    assets/models/tiny_moe/    Qwen3-MoE-style HF config, random init
    assets/models/tiny_qwen2_moe/  Qwen1.5/Qwen2-MoE: a gated shared expert, q/k/v biases
    assets/models/tiny_glm4_moe/   GLM-4.5: dense layer 0, sigmoid + bias routing, shared expert, half-rotary heads
"""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(name: str) -> Path:
    """Absolute path of a shipped asset, e.g. ``asset_path("tokenizer")``.

    Raises ``FileNotFoundError`` naming the missing asset and the ones that exist.
    """
    path = ASSETS_DIR / name
    if not path.exists():
        known = sorted(p.relative_to(ASSETS_DIR).as_posix() for p in ASSETS_DIR.glob("*/*") if p.is_dir())
        raise FileNotFoundError(f"no shipped asset {name!r} under {ASSETS_DIR}; known: {known}")
    return path
