"""Prefill-only scoring through SGLang 0.5.23's `/generate`: the log-prob an engine's model gives each token of a
sequence, as an on-policy distillation teacher scores a student's sampled response (an SGLang server or the embedded
engine; its `megarl/engines/embedded/prefill.py` docstring cites the SGLang code for each fact below).

The request (`prefill_body`): `input_ids` = prompt + response, `sampling_params` {"max_new_tokens": 0} (prefill
only: nothing is sampled, so no temperature applies), `return_logprob`, `logprob_start_len` = start - 1 and, for
top-k, `top_logprobs_num`. The reply's `meta_info.input_token_logprobs` holds one `[logprob, token_id, text|null]`
entry per input token from logprob_start_len on; the first entry's logprob is null (the engine keeps the logits of
the positions from logprob_start_len on, each of which scores the next token), so asking from start - 1 gives every
token from `start` on a log-prob. `input_top_logprobs` is aligned with it (null first, then k entries per position,
likeliest first). The log-probs are log_softmax of the raw logits. `output_ids` is `[]`, finish_reason length 0.

Alignment for the trainer (`response_log_probs`): prompt length P, response length R, input_ids = prompt + response,
start = P: entry j (0 <= j < R) is log p(response[j] | prompt + response[:j]).

From an async worker: `await prefill_log_probs(session, url, keys, prompt + response, len(prompt), top_k)`; errors
are `megarl.rewards.retry`'s (429, 5xx and an aborted request `Transient`, other answers `Permanent`, connection
errors as raised), so `with_retries(lambda: prefill_log_probs(...), retry, "teacher")` tries it again as reward
sources do.
"""

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.sglang_api import check_payload
from megarl.rewards.retry import Permanent, Transient

GENERATE_PATH = "/generate"


@dataclass(kw_only=True, slots=True)
class PrefillLogProbs:
    """Log-probs of the input tokens from `start` on of one sequence; index j is token start + j."""

    start: int
    token_ids: list[int]
    """input_ids[start:], as the engine echoes them."""
    logprobs: list[float]
    """log p(input_ids[start + j] | input_ids[:start + j]); -inf where the model gives the token no mass."""
    top_ids: list[list[int]] | None = None
    """With top_k > 0, per position the k likeliest ids under the same distribution, likeliest first; else None."""
    top_logprobs: list[list[float]] | None = None
    """Their log-probs, aligned with `top_ids`."""


def prefill_body(input_ids: list[int], start: int, top_k: int = 0) -> dict[str, Any]:
    """The `/generate` body scoring tokens start..len(input_ids)-1 of `input_ids` (1 <= start <= len(input_ids):
    token 0 has no prediction), with the top `top_k` log-probs at each position if top_k > 0."""
    if not 1 <= start <= len(input_ids):
        raise ValueError(f"start={start}: score tokens from a position in [1, {len(input_ids)}]")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: use 0 (none) or more")
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
    }
    if top_k:
        body["top_logprobs_num"] = top_k
    check_payload(GENERATE_PATH, body)
    return body


def scored_log_probs(meta_info: dict[str, Any], num_input_tokens: int, start: int) -> PrefillLogProbs:
    """The log-probs of tokens start..num_input_tokens-1 in the `meta_info` of a reply to `prefill_body(input_ids,
    start, top_k)` with len(input_ids) = num_input_tokens: its input entries less the first (null) one. Raises
    ValueError when the entries do not cover exactly those tokens."""
    entries = meta_info.get("input_token_logprobs")
    expected = num_input_tokens - start + 1  # tokens start - 1 .. num_input_tokens - 1
    if not isinstance(entries, list) or len(entries) != expected or entries[0][0] is not None:
        count = None if not isinstance(entries, list) else len(entries)
        raise ValueError(
            f"meta_info.input_token_logprobs: {count} entries, want {expected} (tokens {start - 1}.."
            f"{num_input_tokens - 1}) with a null first log-prob: was it asked with logprob_start_len={start - 1}?"
        )
    result = PrefillLogProbs(
        start=start, token_ids=[int(e[1]) for e in entries[1:]], logprobs=[_value(e[0]) for e in entries[1:]]
    )
    tops = meta_info.get("input_top_logprobs")
    if tops is not None:
        if len(tops) != expected or tops[0] is not None:
            raise ValueError(f"meta_info.input_top_logprobs: {len(tops)} entries, want {expected} with a null first")
        result.top_ids = [[int(e[1]) for e in position] for position in tops[1:]]
        result.top_logprobs = [[_value(e[0]) for e in position] for position in tops[1:]]
    return result


def response_log_probs(meta_info: dict[str, Any], prompt_len: int, response_len: int) -> PrefillLogProbs:
    """What the trainer reads of a reply to `prefill_body(prompt + response, len(prompt), top_k)`: `response_len`
    log-probs, entry j = log p(response[j] | prompt + response[:j]) (and the top-k at each, if asked)."""
    return scored_log_probs(meta_info, prompt_len + response_len, prompt_len)


async def prefill_log_probs(
    session: aiohttp.ClientSession,
    url: str,
    keys: EngineKeys | None,
    input_ids: list[int],
    start: int,
    top_k: int = 0,
) -> PrefillLogProbs:
    """Score tokens start.. of `input_ids` on the engine at `url` (its base URL) with one `/generate` call carrying
    the key `keys` gives it (SGLang's --api-key). The session bounds the time; see the module docstring for errors."""
    key = None if keys is None else keys.for_path(GENERATE_PATH)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    target = url.rstrip("/") + GENERATE_PATH
    async with session.post(target, json=prefill_body(input_ids, start, top_k), headers=headers) as resp:
        text = await resp.text()
        if resp.status == 429 or resp.status >= 500:
            raise Transient(f"POST {target} returned HTTP {resp.status}: {text[:300]}")
        if resp.status != 200:
            raise Permanent(f"POST {target} returned HTTP {resp.status}: {text[:300]}")
    try:
        meta = json.loads(text)["meta_info"]
    except (ValueError, KeyError, TypeError):
        raise Permanent(f"POST {target} answered {text[:300]!r}, not a /generate reply") from None
    if (meta.get("finish_reason") or {}).get("type") == "abort":  # a pause in abort mode, a shutdown: try again
        raise Transient(f"POST {target}: the engine aborted the request: {meta['finish_reason'].get('message')}")
    result = scored_log_probs(meta, len(input_ids), start)
    if result.token_ids != list(input_ids[start:]):
        raise Permanent(f"POST {target}: the reply scores other tokens than input_ids[{start}:]")
    return result


def _value(logprob: float | None) -> float:
    """An entry's log-prob; null stands for -inf (SGLang's JSON encoder writes -inf so)."""
    return float("-inf") if logprob is None else float(logprob)
