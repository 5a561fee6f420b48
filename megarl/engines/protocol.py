"""SGLang 0.5.23's HTTP protocol as megarl uses it: endpoint paths, request fields, response parsing.

Transcribed from the sglang==0.5.23 sources (see ../shared/SGLANG_PROTOCOL.md): paths from
`srt/entrypoints/http_server.py`, request fields and defaults from `srt/managers/io_struct.py`,
sampling fields from `srt/sampling/sampling_params.py::SamplingParams`, response layout from
`srt/managers/tokenizer_manager.py::_handle_batch_output`. The embedded engine serves exactly these,
and the contract tests check every payload the client sends against `REQUEST_FIELDS`.
"""

from dataclasses import dataclass
from typing import Any

REQUIRED = object()
"""Marks a request field without a default."""

REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    # io_struct.GenerateReqInput (only the fields megarl sends or the embedded engine reads)
    "/generate": {
        "input_ids": REQUIRED,
        "sampling_params": None,
        "rid": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    },
    # io_struct.AbortReq
    "/abort_request": {"rid": "", "abort_all": False},
    # io_struct.PauseGenerationReqInput
    "/pause_generation": {"mode": "abort"},
    # tokenizer_manager.continue_generation
    "/continue_generation": {"torch_empty_cache": True},
    # io_struct.ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput
    "/release_memory_occupation": {"tags": None},
    "/resume_memory_occupation": {"tags": None},
    # scheduler_components/weight_updater.py begin/end session
    "/begin_weight_update": {"selector": "all"},
    "/end_weight_update": {},
    # io_struct.UpdateWeightsFromTensorReqInput
    "/update_weights_from_tensor": {
        "serialized_named_tensors": REQUIRED,
        "load_format": None,
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": None,
    },
    # io_struct.InitWeightsUpdateGroupReqInput
    "/init_weights_update_group": {
        "master_address": REQUIRED,
        "master_port": REQUIRED,
        "rank_offset": REQUIRED,
        "world_size": REQUIRED,
        "group_name": "weight_update_group",
        "backend": "nccl",
    },
    # io_struct.DestroyWeightsUpdateGroupReqInput
    "/destroy_weights_update_group": {"group_name": "weight_update_group"},
    # io_struct.UpdateWeightsFromDistributedReqInput
    "/update_weights_from_distributed": {
        "names": REQUIRED,
        "dtypes": REQUIRED,
        "shapes": REQUIRED,
        "group_name": "weight_update_group",
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": None,
        "load_format": None,
    },
    # http_server.update_weight_version
    "/update_weight_version": {"new_version": REQUIRED, "abort_all_requests": True},
}

REQUEST_STRUCTS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}
"""The `srt/managers/io_struct.py` class each path's body is; tests/test_sglang_contract.py reads those
classes from the pinned wheel and checks REQUEST_FIELDS against them field by field."""

SAMPLING_FIELDS: dict[str, Any] = {
    # sampling_params.SamplingParams.__init__ defaults; `seed` is not a field (400), `sampling_seed` is.
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "min_new_tokens": 0,
    "sampling_seed": None,
}

GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this sample greedily (sampling_params.py)."""

HEALTH_PATH = "/health_generate"
"""Ready once this answers 200: the port opens before warm-up, `/model_info` answers before it too."""

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""Tags of release/resume_memory_occupation (srt/constants.py GPU_MEMORY_TYPE_*)."""

DEFAULT_GROUP_NAME = "weight_update_group"


def check_payload(path: str, payload: dict[str, Any]) -> None:
    """Raise ValueError if `payload` has a field `path` does not define or lacks a required one."""
    fields = REQUEST_FIELDS[path]
    unknown = sorted(set(payload) - set(fields))
    missing = sorted(k for k, v in fields.items() if v is REQUIRED and k not in payload)
    if unknown or missing:
        raise ValueError(f"{path}: unknown fields {unknown}, missing required {missing}")
    sampling = payload.get("sampling_params")
    for params in sampling if isinstance(sampling, list) else [sampling or {}]:
        bad = sorted(set(params) - set(SAMPLING_FIELDS))
        if bad:
            raise ValueError(f"{path}: unknown sampling_params {bad} (SGLang's seed field is sampling_seed)")


@dataclass(kw_only=True, slots=True)
class FinishReason:
    """`meta_info.finish_reason` (schedule_batch.FINISH_*.to_json)."""

    type: str
    """stop (EOS or a stop token) | length (max_new_tokens or the context) | abort."""
    matched: int | str | None = None
    """The stop token id (or string) that ended generation."""
    length: int | None = None
    """Tokens generated when `type` is length."""
    message: str | None = None
    """Why the request was aborted."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "FinishReason":
        return cls(type=obj["type"], matched=obj.get("matched"), length=obj.get("length"), message=obj.get("message"))

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass(kw_only=True, slots=True)
class GenerateResult:
    """One sample of `/generate`: the tokens, their log-probs and why generation ended."""

    rid: str
    output_ids: list[int]
    """Generated ids; the EOS/stop token that ended generation is kept."""
    output_logprobs: list[float] | None
    """Log-prob of each output id under the sampling temperature; None unless requested."""
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the engine took from its prefix cache."""
    weight_version: str | None
    """The engine's weight version when the request finished."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "GenerateResult":
        meta = obj["meta_info"]
        entries = meta.get("output_token_logprobs")
        return cls(
            rid=meta["id"],
            output_ids=list(obj["output_ids"]),
            output_logprobs=None if entries is None else [_logprob(e[0]) for e in entries],
            finish_reason=FinishReason.from_json(meta["finish_reason"]),
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=meta.get("weight_version"),
        )


def _logprob(value: float | None) -> float:
    """Log-prob entries are null for -inf (tokenizer_manager.detokenize_logprob_tokens)."""
    return float("-inf") if value is None else float(value)
