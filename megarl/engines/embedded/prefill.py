"""Input (prompt) log-probs and prefill-only requests, as SGLang 0.5.23 serves them (an on-policy distillation
teacher scores a student's tokens this way: prompt + response as `input_ids`, `max_new_tokens` 0).

What SGLang does (read in the sglang==0.5.23 wheel, under `sglang/srt/`):

- `logprob_start_len` defaults to -1 (`managers/io_struct.py::GenerateReqInput._normalize_single_inputs`; in a
  batch one value or one per prompt, a list refused with n > 1: `_normalize_logprob_params`). It is ignored without
  return_logprob; -1 means no input positions; above the prompt length the request fails with 400
  (`managers/scheduler.py::handle_generate_request`: "req.logprob_start_len=S is higher than the number of input
  tokens len(req.origin_input_ids)=P. Please use a smaller logprob_start_len.").
- With s = logprob_start_len >= 0 the forward keeps the logits of prompt positions s..P-1, position p's scoring
  token p+1 (`managers/schedule_batch.py::ScheduleBatch.prepare_for_extend`, `layers/logits_processor.py::
  _get_pruned_states`); the prefix cache is matched only up to s (`schedule_batch.py::Req._compute_max_prefix_len`),
  and the log-probs are the log_softmax of the raw logits: no temperature, unlike output log-probs
  (`layers/logprob_processor.py::InputLogprobProcessor._forward_by_chunk`).
- `meta_info.input_token_logprobs` then has P - s entries, entry e for prompt token s + e: values `[None] +
  logprobs[:-1]` (the first has no prediction, the last position's, which scores the next token, is dropped) and ids
  `origin_input_ids[s:]` (`managers/scheduler_components/logprob_result_processor.py::
  _process_input_token_logprobs`). Each entry is `(logprob, token_id, text-or-None)` (`managers/tokenizer_manager.py::
  detokenize_logprob_tokens`), -inf written as null by the JSON encoder. With s = P, or -1, it is `[]`
  (`_initialize_empty_logprob_containers`); it is present whenever return_logprob is (`add_logprob_to_meta_info`).
- `input_top_logprobs` (top_logprobs_num = k > 0) is aligned with it: None first, then per position a list of k
  `(logprob, id, None)`, likeliest first (`_process_input_top_logprobs`, `detokenize_top_logprobs_tokens`), and so is
  `input_token_ids_logprobs` with token_ids_logprob (`_process_input_token_ids_logprobs`).
- `max_new_tokens` may be 0 (`sampling/sampling_params.py::SamplingParams.verify`): a prefill-only request
  (`schedule_batch.py::Req.is_prefill_only`). Nothing is sampled (`managers/tp_worker.py::
  forward_batch_generation`: a dummy id 0) and it finishes with `{"type": "length", "length": 0}`, `output_ids` `[]`
  (`Req.update_finish_state`, `output_ids_through_stop`). Its `output_token_logprobs` is `[]`, but with k > 0
  `output_top_logprobs` (and with token_ids_logprob `output_token_ids_logprobs`) holds one entry, the distribution
  after the last prompt token, again without temperature (`model_runner.py::compute_logprobs_only`;
  `output_streamer.py` slices output log-probs up to max(len(output_ids), 1)). That holds for a batch of
  prefill-only requests; one batched with generating requests is sampled and gets one output log-prob too, which
  the embedded engine does not mimic.
- Mixed with generation (max_new_tokens > 0), the request returns both: input entries from s and output ones.

Here an admitted sequence that asks for input log-probs (or is prefill-only) gets one unpadded forward of its
prompt without KV cache, keeping the logits of the positions it needs, before the batched prefill that samples
its first token; prefill-only sequences end there. A retracted sequence keeps the input log-probs it has.
"""

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from megarl.engines.client.sglang_api import FinishReason
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.routing import RoutingRecorder
from megarl.engines.embedded.vision import VisionPrompt, vision_forward_inputs

if TYPE_CHECKING:  # peft is imported only by an engine that serves LoRA (engine.py::_adapters)
    from megarl.engines.embedded.lora import EngineAdapters


def score_admitted(
    model: PreTrainedModel,
    seqs: list[Sequence],
    adapters: "EngineAdapters | None" = None,
    recorder: RoutingRecorder | None = None,
) -> list[Sequence]:
    """Give the just-admitted `seqs` that ask for them their input log-probs and end the prefill-only ones (finish
    length 0); the rest, which go on to the batched prefill, in order."""
    generating = []
    for s in seqs:
        prefill_only = s.max_new_tokens == 0
        if prefill_only or (s.logprob_start_len is not None and s.input_logprobs is None):
            _score(model, s, adapters, recorder, prefill_only)
        if prefill_only:
            s.finish = FinishReason(type="length", length=0)
        else:
            generating.append(s)
    return generating


@torch.no_grad()
def _score(
    model: PreTrainedModel,
    seq: Sequence,
    adapters: "EngineAdapters | None",
    recorder: RoutingRecorder | None,
    prefill_only: bool,
) -> None:
    """Forward `seq.prompt` once; keep the input log-probs it asks for and, if prefill-only, what SGLang returns of
    the last position (its routed experts too: prompt - 1 rows, as for a finished request)."""
    prompt, start = seq.prompt, seq.logprob_start_len
    first = len(prompt) - 1 if start is None else min(start, len(prompt) - 1)
    logprobs = _last_logprobs(model, seq, len(prompt) - first, adapters)  # [P - first, v]
    if recorder is not None:  # the forward's routing; recorder.take also clears it
        routing = recorder.take(1, len(prompt))[0]
        if prefill_only and seq.routed_experts_start_len is not None:
            seq.routing = [routing[:-1]]
    if start is not None:
        _keep_inputs(seq, logprobs[start - first : -1], start)
    if prefill_only:
        seq.keep_position_logprobs(logprobs[-1])


def _last_logprobs(model: PreTrainedModel, seq: Sequence, keep: int, adapters: "EngineAdapters | None") -> torch.Tensor:
    """fp32 log_softmax of the raw logits at the last `keep` positions of `seq.prompt` (with its images), [keep, v]
    on the CPU: row j is the distribution of the token after position len(prompt) - keep + j."""
    inputs = _prompt_inputs(model, seq.prompt, seq.vision)
    with adapters.rows([seq.lora_name]) if adapters else contextlib.nullcontext():
        out = model(**inputs, use_cache=False, logits_to_keep=keep)
    return torch.log_softmax(out.logits[0].float(), dim=-1).cpu()


def _prompt_inputs(model: PreTrainedModel, prompt: list[int], vision: VisionPrompt | None) -> dict[str, Any]:
    """A forward's inputs for `prompt`: its ids, and its images with their 3-D positions if it has some."""
    if vision is not None:
        return vision_forward_inputs(model, prompt, vision)[0]
    return {"input_ids": torch.tensor([prompt], device=next(model.parameters()).device)}


def _keep_inputs(seq: Sequence, rows: torch.Tensor, start: int) -> None:
    """Keep, from `rows` [P - start - 1, v] (the distributions of prompt tokens start+1..P-1), what `seq` asks."""
    targets = torch.tensor(seq.prompt[start + 1 :], dtype=torch.long)
    seq.input_logprobs = rows.gather(-1, targets[:, None])[:, 0].tolist()
    if seq.top_logprobs_num > 0:
        values, ids = rows.topk(min(seq.top_logprobs_num, rows.shape[-1]), dim=-1)
        pairs = zip(values.tolist(), ids.tolist(), strict=True)
        seq.input_top_logprobs = [list(zip(v, i, strict=True)) for v, i in pairs]
    if seq.token_ids_logprob is not None:
        seq.input_token_ids_logprobs = rows[:, seq.token_ids_logprob].tolist()
