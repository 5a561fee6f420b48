"""`/generate` bodies → engine sequences, and finished sequences → SGLang's response objects."""

import dataclasses
import time
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from megarl.engines.client.sglang_api import SAMPLING_FIELDS, check_payload
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine
from megarl.engines.embedded.routing import encode
from megarl.engines.embedded.sampler import RowSampling
from megarl.engines.embedded.vision import VisionPrompt, images_per_prompt

_UNSUPPORTED_IF_SET = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "min_new_tokens")


class BadRequest(ValueError):
    """The request is invalid; answered with HTTP 400 and this message."""


def parse_generate(body: dict[str, Any], engine: EmbeddedEngine) -> tuple[list[Sequence], bool, bool]:
    """The sequences to run (prompt-major, n per prompt), whether a list is returned, and return_logprob."""
    if "text" in body:
        raise BadRequest("the embedded engine takes input_ids only (like SGLang with --skip-tokenizer-init)")
    try:
        check_payload("/generate", body)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded engine")
    ids = body["input_ids"]
    batched = bool(ids) and isinstance(ids[0], list)
    prompts, visions = _with_images(body.get("image_data"), batched, ids if batched else [ids], engine)
    params = body.get("sampling_params") or {}
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise BadRequest(f"{len(per_prompt)} sampling_params for {len(prompts)} prompts")
    rid = body.get("rid")
    start_len = _routed_experts_start_len(body, prompts)
    adapters = _lora_paths(body.get("lora_path"), len(prompts))
    token_ids = _token_ids_logprob(body.get("token_ids_logprob"), batched, per_prompt, engine.vocab_size)
    top_num = _top_logprobs_num(body.get("top_logprobs_num", 0))
    return_logprob = bool(body.get("return_logprob", False))
    starts = _logprob_start_lens(body.get("logprob_start_len"), prompts, per_prompt, return_logprob)
    seqs: list[Sequence] = []
    for i, (prompt, sp) in enumerate(zip(prompts, per_prompt, strict=True)):
        n = int(sp.get("n", 1))
        base = rid if not batched or rid is None else f"{rid}_{i}"
        for j in range(n):
            sample_rid = base if n == 1 and base is not None else uuid.uuid4().hex
            seq = _sequence(sample_rid, prompt, sp, j, engine)
            seq.routed_experts_start_len = start_len
            seq.lora_name = adapters[i]
            seq.token_ids_logprob, seq.top_logprobs_num = token_ids[i], top_num
            seq.logprob_start_len = starts[i]
            seq.vision = visions[i]
            seqs.append(seq)
    return seqs, batched or len(seqs) > 1, return_logprob


def _with_images(
    image_data: Any, batched: bool, prompts: list[list[int]], engine: EmbeddedEngine
) -> tuple[list[list[int]], list[VisionPrompt | None]]:
    """Each prompt with its image placeholders expanded, and its images (None: a text prompt), as SGLang's
    multimodal processor makes them (vision.py); 400 for images the engine cannot take or that do not match."""
    try:
        images = images_per_prompt(image_data, batched, len(prompts))
    except ValueError as e:
        raise BadRequest(str(e)) from e
    if engine.vision is None:
        if any(images):
            raise BadRequest("image_data given, but the served model is not a vision-language model")
        return prompts, [None] * len(prompts)
    expanded: list[list[int]] = []
    visions: list[VisionPrompt | None] = []
    for prompt, prompt_images in zip(prompts, images, strict=True):
        try:
            ids, vision = engine.vision.prepare(prompt, prompt_images) if prompt_images else (prompt, None)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if vision is None and engine.vision.image_token_id in prompt:
            raise BadRequest(f"input_ids hold image placeholders (id {engine.vision.image_token_id}) but no image_data")
        expanded.append(ids)
        visions.append(vision)
    return expanded, visions


def _lora_paths(lora_path: Any, num_prompts: int) -> list[str | None]:
    """Each prompt's LoRA adapter: one name for all, or one per prompt, None = the base model (io_struct.py::
    GenerateReqInput._normalize_lora_paths)."""
    paths = [lora_path] * num_prompts if lora_path is None or isinstance(lora_path, str) else lora_path
    if (
        not isinstance(paths, list)
        or len(paths) != num_prompts
        or not all(p is None or isinstance(p, str) for p in paths)
    ):
        raise BadRequest(f"lora_path={lora_path!r}: give one adapter name, or a list of one (or null) per prompt")
    return [p or None for p in paths]


def _token_ids_logprob(
    value: Any, batched: bool, per_prompt: list[dict[str, Any]], vocab_size: int
) -> list[list[int] | None]:
    """Each prompt's `token_ids_logprob` (None = none): one flat list of ids for all prompts, or in a batch one list
    per prompt, which SGLang refuses with n > 1 (io_struct.py::GenerateReqInput._normalize_logprob_params); every id
    in [0, vocab) (tokenizer_manager.py::_validate_token_ids_logprob)."""
    if not value:  # None and [] both mean none
        return [None] * len(per_prompt)
    nested = batched and isinstance(value, list) and isinstance(value[0], list)
    lists = value if nested else [value] * len(per_prompt)
    if nested and (len(lists) != len(per_prompt) or any(int(sp.get("n", 1)) > 1 for sp in per_prompt)):
        raise BadRequest("token_ids_logprob: give one list per prompt, and only with n = 1")
    for ids in lists:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("token_ids_logprob must be a flat list of integers.")
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise BadRequest(
                f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; valid range is [0, {vocab_size})."
            )
    return [list(ids) or None for ids in lists]


def _logprob_start_lens(
    value: Any, prompts: list[list[int]], per_prompt: list[dict[str, Any]], return_logprob: bool
) -> list[int | None]:
    """Each prompt's first input position with a log-prob, None = none (-1, or no return_logprob): one value for
    all prompts, or one per prompt of a batch with n = 1 (io_struct.py::GenerateReqInput._normalize_logprob_params);
    above the prompt's length refused in SGLang's words (scheduler.py::handle_generate_request). SGLang leaves other
    negative values undefined; the embedded engine refuses them."""
    value = -1 if value is None else value
    starts = value if isinstance(value, list) else [value] * len(prompts)
    if len(starts) != len(prompts) or (isinstance(value, list) and any(int(sp.get("n", 1)) > 1 for sp in per_prompt)):
        raise BadRequest("logprob_start_len: give one integer, or in a batch one per prompt (a list only with n = 1)")
    if not return_logprob:
        return [None] * len(prompts)
    for start, prompt in zip(starts, prompts, strict=True):
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise BadRequest(f"logprob_start_len={start!r}: use -1 (output log-probs only) or a prompt position >= 0")
        if start > len(prompt):
            raise BadRequest(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller logprob_start_len."
            )
    return [None if start == -1 else start for start in starts]


def _top_logprobs_num(value: Any) -> int:
    """The request's `top_logprobs_num` (the embedded engine takes one for all prompts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"top_logprobs_num={value!r}: the embedded engine takes one non-negative integer")
    return value


def _routed_experts_start_len(body: dict[str, Any], prompts: list[list[int]]) -> int | None:
    """The routed_experts_start_len of a request with return_routed_experts, else None. Checked like
    scheduler.py::handle_generate_request checks it (with or without --enable-return-routed-experts): it must
    lie in [0, prompt tokens], else the request fails with 400."""
    if not body.get("return_routed_experts", False):
        return None
    start = body.get("routed_experts_start_len", 0)
    if not isinstance(start, int):
        raise BadRequest(f"routed_experts_start_len={start!r} must be an integer")
    if start < 0:
        raise BadRequest(f"routed_experts_start_len={start!r} is lower than 0; use a non-negative one")
    if too_short := [len(p) for p in prompts if start > len(p)]:
        raise BadRequest(
            f"routed_experts_start_len={start} is higher than the number of input tokens ({too_short[0]}); "
            "use a smaller routed_experts_start_len"
        )
    return start


def _sequence(rid: str, prompt: list[int], sp: dict[str, Any], index: int, engine: EmbeddedEngine) -> Sequence:
    if not prompt or not all(isinstance(t, int) for t in prompt):
        raise BadRequest("input_ids must be a non-empty list of token ids")
    if bad := [t for t in prompt if not 0 <= t < engine.vocab_size]:
        raise BadRequest(f"input_ids holds {bad[0]}, outside the model's vocabulary [0, {engine.vocab_size})")
    for key in _UNSUPPORTED_IF_SET:
        if sp.get(key, SAMPLING_FIELDS[key]) not in (SAMPLING_FIELDS[key], None, []):
            raise BadRequest(f"sampling_params.{key} is not supported by the embedded engine")
    temperature, top_p, top_k = float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), int(sp.get("top_k", -1))
    if temperature < 0 or not 0 < top_p <= 1 or top_k == 0 or top_k < -1:
        raise BadRequest(f"bad sampling_params temperature={temperature} top_p={top_p} top_k={top_k}")
    room = engine.context_length - len(prompt)
    if room <= 0:
        raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the context length {engine.context_length}")
    max_new = sp.get("max_new_tokens", SAMPLING_FIELDS["max_new_tokens"])
    if max_new is not None and (int(max_new) < 0 or int(max_new) > room):  # 0: prefill only (prefill.py)
        raise BadRequest(
            f"max_new_tokens={max_new} with a {len(prompt)}-token prompt must be in [0, {room}] "
            f"(context length {engine.context_length})"
        )
    seed = sp.get("sampling_seed")
    stop_ids = frozenset() if sp.get("ignore_eos") else engine.eos_ids | set(sp.get("stop_token_ids") or [])
    return Sequence(
        rid=rid,
        prompt=list(prompt),
        sampling=RowSampling(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=None if seed is None else torch.Generator().manual_seed(int(seed) + index),
        ),
        max_new_tokens=room if max_new is None else int(max_new),
        stop_ids=stop_ids,
    )


def response(seq: Sequence, return_logprob: bool, started: float) -> dict[str, Any]:
    """One element of SGLang's /generate reply (no `text`: the engine has no tokenizer). `weight_versions` and
    `weight_version` (its last span's) as weight_versions.py::add_weight_versions_to_meta_info writes them."""
    assert seq.finish is not None
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish.to_json(),
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "cached_tokens": seq.cached_tokens,
        "num_retractions": seq.retractions,
        "e2e_latency": time.monotonic() - started,
        "weight_version": seq.version_spans[-1].version,
        "weight_versions": [dataclasses.asdict(span) for span in seq.version_spans],
    }
    if return_logprob:
        meta |= _logprob_meta(seq)
    if seq.routed_experts_start_len is not None and seq.routing:
        meta["routed_experts"] = encode(_routed_rows(seq, seq.routed_experts_start_len))
    return {"output_ids": list(seq.output), "meta_info": meta}


def _logprob_meta(seq: Sequence) -> dict[str, Any]:
    """The log-probs SGLang returns with return_logprob (tokenizer_manager.py::add_logprob_to_meta_info): entries
    [logprob, token id, null] (no text: no tokenizer), -inf as null; the input ones of prompt positions from
    logprob_start_len on (`_input_logprob_meta`); `output_top_logprobs` with top_logprobs_num > 0 and
    `output_token_ids_logprobs` with token_ids_logprob, one list per output position (one for a prefill-only
    request: prefill.py)."""
    output = _entries(zip(seq.logprobs, seq.output, strict=True))
    meta: dict[str, Any] = {"output_token_logprobs": output, "output_token_logprobs_length": len(output)}
    if seq.top_logprobs_num > 0:
        meta["output_top_logprobs"] = [_entries(position) for position in seq.top_logprobs]
    if seq.token_ids_logprob is not None:
        ids = seq.token_ids_logprob
        meta["output_token_ids_logprobs"] = [_entries(zip(lps, ids, strict=True)) for lps in seq.token_ids_logprobs]
    return meta | _input_logprob_meta(seq)


def _input_logprob_meta(seq: Sequence) -> dict[str, Any]:
    """`input_token_logprobs`: entries for prompt tokens logprob_start_len.., the first [null, id, null] (nothing
    predicts it here); [] without input log-probs, or for a request aborted before its prompt was scored
    (tokenizer_manager.py::_handle_abort_req); `input_top_logprobs` and `input_token_ids_logprobs` aligned with it,
    null first (logprob_result_processor.py::_process_input_token_logprobs and its siblings)."""
    tokens: list[Any] = []
    tops: list[Any] = []
    by_id: list[Any] = []
    start = seq.logprob_start_len
    if start is not None and start < len(seq.prompt) and seq.input_logprobs is not None:
        first, rest = [None, seq.prompt[start], None], zip(seq.input_logprobs, seq.prompt[start + 1 :], strict=True)
        tokens = [first, *_entries(rest)]
        tops = [None, *(_entries(position) for position in seq.input_top_logprobs)]
        ids = seq.token_ids_logprob or []
        by_id = [None, *(_entries(zip(lps, ids, strict=True)) for lps in seq.input_token_ids_logprobs)]
    meta: dict[str, Any] = {"input_token_logprobs": tokens}
    if seq.top_logprobs_num > 0:
        meta["input_top_logprobs"] = tops
    if seq.token_ids_logprob is not None:
        meta["input_token_ids_logprobs"] = by_id
    return meta


def _entries(pairs: Iterable[tuple[float, int]]) -> list[list[Any]]:
    return [[None if lp == float("-inf") else lp, t, None] for lp, t in pairs]


def _routed_rows(seq: Sequence, start_len: int) -> torch.Tensor:
    """Rows [start_len, seqlen - 1) of the sequence's routing, seqlen = prompt + output, start_len clamped to
    seqlen - 1 (batch_result_processor.py::_maybe_collect_routed_experts, base.py::get_topk)."""
    routing = torch.cat(seq.routing)
    seqlen = len(seq.prompt) + len(seq.output)
    assert len(routing) == seqlen - 1, f"{len(routing)} routing rows for {seqlen} tokens"
    return routing[min(start_len, seqlen - 1) :]
