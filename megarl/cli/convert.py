"""`megarl-convert`: HF safetensors ⇄ Megatron dist checkpoints — not yet available in this version."""

import sys


def main() -> None:
    print(
        "megarl-convert: not yet available; HF ⇄ Megatron checkpoint conversion lands with the checkpoint work",
        file=sys.stderr,
    )
    sys.exit(2)
