"""SGLang 0.5.23's `/classify` replies (a reward model served with `--is-embedding`): what the embedded engine answers
and what the client reads of them. The request's fields are in `sglang_api.REQUEST_FIELDS["/classify"]`."""

from typing import Any


def classify_reply(rid: str, embedding: list[float], prompt_tokens: int, version: str, latency_s: float) -> dict:
    """One prompt's `/classify` reply (tokenizer_manager.py::_handle_batch_output, BatchEmbeddingOutput branch: no
    completion or cache counts). `embedding`: a classifier's logits at the last token, one per label (`Pooler(LAST,
    normalize=False)`, srt/models/qwen2_classification.py). finish_reason is length 0: max_new_tokens is set to 0
    (io_struct.py::EmbeddingReqInput.normalize_batch_and_arguments) and one dummy token appended."""
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": prompt_tokens}
    meta |= {"weight_version": version, "num_retractions": 0, "e2e_latency": latency_s}
    return {"embedding": embedding, "meta_info": meta}


def classify_scores(reply: Any) -> list[float]:
    """Logit 0 (a reward model's score) of each prompt of a `/classify` reply: a list for a batch, one object for a
    single prompt."""
    return [float(one["embedding"][0]) for one in (reply if isinstance(reply, list) else [reply])]
