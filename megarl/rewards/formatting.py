"""A conversation as a reward model reads it: rendered with the RM's own chat template, tokenized, cut to its budget.

The discriminative RM's two backends (SGLang `/classify` replicas, `megarl.scoring.classify`; the Megatron role)
read the same tokens, so a checkpoint scores a trajectory the same way on either.
"""

from typing import Any

from transformers import PreTrainedTokenizerBase


def rm_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    max_length: int,
    chat_template_kwargs: dict[str, Any],
) -> list[int]:
    """`messages` through the tokenizer's chat template (no generation prompt: the RM scores the last turn as it
    stands), tokenized without adding special tokens again; longer than `max_length`, the LAST `max_length` tokens
    (the response and the template's closing tokens, which a last-token classifier reads, are at the end)."""
    if max_length < 1:
        raise ValueError(f"rm_token_ids: max_length must be >= 1, got {max_length}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **chat_template_kwargs)
    assert isinstance(text, str), "apply_chat_template(tokenize=False) renders one string"
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[-max_length:]
