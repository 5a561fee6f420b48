"""Token ids of new chat messages, appended to a trajectory without re-encoding earlier turns.

A multi-turn trajectory is `prompt ids + model ids + delta ids + model ids + ...`. The model's own
ids are kept as generated; only new tool/user messages are tokenized, as the chat template's delta:

    delta(messages) = render([system, *messages], add_generation_prompt=True) − render([system])

so no system prompt is repeated. The template closes an assistant turn with EOS plus a tail (ChatML:
`<|im_end|>` then `\\n`); the model generates the EOS, so the delta starts with the tail, or with
EOS + tail when the model's turn stopped on something else. This needs a template whose turns
render independently of later ones (checked once here; megarl's shipped template is built so).
"""

from typing import Any

_PROBE = "megarl-probe"


class ChatTokens:
    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = chat_template_kwargs or {}
        self.eos_ids = frozenset(_eos_ids(tokenizer))
        self._system = [{"role": "system", "content": _PROBE}]
        self._prefix = self.encode(self._system, add_generation_prompt=False)
        user = [*self._system, {"role": "user", "content": _PROBE}]
        head = self.encode(user, add_generation_prompt=True)
        full = self.encode([*user, {"role": "assistant", "content": _PROBE}], add_generation_prompt=False)
        if full[: len(head)] != head:
            raise ValueError(
                "the chat template renders earlier turns differently once a reply follows; "
                "token-in/token-out multi-turn rollout needs a prefix-stable template"
            )
        reply = full[len(head) :]
        ends = [i for i, t in enumerate(reply) if t in self.eos_ids]
        if not ends:
            raise ValueError(f"the chat template closes an assistant turn without an EOS token {sorted(self.eos_ids)}")
        self.turn_close = reply[ends[-1] :]
        """EOS and the tail the template puts after it (`<|im_end|>\\n`)."""

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def delta(self, messages: list[dict[str, Any]], model_ended_with_eos: bool) -> list[int]:
        """Ids to append after the model's turn: close its turn, then `messages`, then the assistant header."""
        ids = self.encode([*self._system, *messages], add_generation_prompt=True)
        if ids[: len(self._prefix)] != self._prefix:
            raise ValueError("the chat template renders the system turn differently when messages follow")
        close = self.turn_close[1:] if model_ended_with_eos else self.turn_close
        return close + ids[len(self._prefix) :]

    def decode_reply(self, ids: list[int]) -> str:
        """The text of a model turn for tool-call parsing and for interactions (EOS dropped)."""
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=False)


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; agent loops need it to close the model's turns")
    return list(eos) if isinstance(eos, list) else [eos]
