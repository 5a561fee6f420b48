"""Build the vision-language tokenizer and processor megarl ships (`megarl/assets/tokenizer_vl/`).

It is `megarl/assets/tokenizer/` with Qwen2.5-VL's four vision tokens appended as special tokens (ids 4096-4099,
so text token ids are unchanged), a chat template whose message content may be a list of `{"type": "image"}` /
`{"type": "text", "text": ...}` parts (an image part renders as `<|vision_start|><|image_pad|><|vision_end|>`, the
placeholder transformers' Qwen2.5-VL processor expands to one `<|image_pad|>` per merged patch), and the image
processor's config at tiny sizes (14-pixel patches, 2×2 merge: one image token per 28×28 pixels).

Deterministic: the same inputs give byte-identical files.

    python tools/build_vl_tokenizer.py [--out DIR]
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT_TOKENIZER = REPO_ROOT / "megarl/assets/tokenizer"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Ids 4096-4099, in this order (the order of Qwen2.5-VL's own vocabulary)."""
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 3136, "longest_edge": 50176},
}
"""Between 4 and 64 image tokens per image (`size` is in pixels: 56², 224²)."""


def chat_template() -> str:
    """The text template with list contents rendered part by part (images as their placeholder)."""
    text = (TEXT_TOKENIZER / "chat_template.jinja").read_text()
    macro = (
        "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
        "{%- for part in content -%}{%- if part.type == 'image' or part.type == 'image_url' -%}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
        "{%- elif part.type == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
        "{%- else -%}{{- part.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}\n"
    )
    replaced = text.replace("message.content + '<|im_end|>", "render(message.content) + '<|im_end|>")
    tool = "'\\n<tool_response>\\n' + "
    replaced = replaced.replace(tool + "message.content", tool + "render(message.content)")
    assert replaced.count("render(message.content)") == 2, "the text chat template changed: update build_vl_tokenizer"
    end_of_comment = replaced.index("-#}") + len("-#}\n")
    return replaced[:end_of_comment] + macro + replaced[end_of_comment:]


def build(out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TEXT_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == list(range(4096, 4100)), ids
    tokenizer.chat_template = chat_template()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "megarl/assets/tokenizer_vl")
    build(parser.parse_args().out)


if __name__ == "__main__":
    main()
