"""SGLang 0.5.23's HTTP protocol as megarl uses it: endpoint paths, request fields, response parsing.

Transcribed from the sglang==0.5.23 sources (see ../shared/SGLANG_PROTOCOL.md): paths from
`srt/entrypoints/http_server.py`, request fields and defaults from `srt/managers/io_struct.py`,
sampling fields from `srt/sampling/sampling_params.py::SamplingParams`, response layout from
`srt/managers/tokenizer_manager.py::_handle_batch_output`. The embedded engine serves exactly these,
and the contract tests check every payload the client sends against `REQUEST_FIELDS`.
"""

import base64
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

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
        "token_ids_logprob": None,  # ids whose log-probs meta_info.output_token_ids_logprobs gives at each position
        "stream": False,
        "return_routed_experts": False,
        "routed_experts_start_len": 0,
        "lora_path": None,  # an adapter name (or one per prompt of a batch); None = the base model
        "image_data": None,  # a prompt's images (`image_data_field`); its input_ids hold one placeholder per image
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
    # io_struct.GetWeightsByNameReqInput
    "/get_weights_by_name": {"name": REQUIRED, "truncate_size": 100},
    # io_struct.LoadLoRAAdapterFromTensorsReqInput: a PEFT adapter_config.json dict, and one entry per engine TP rank
    # of a `{name: tensor}` dict (tensor_handles.serialize_tensor_dict) or a flattened bucket; answered with
    # io_struct.LoRAUpdateOutput {success, error_message, loaded_adapters}, HTTP 400 on failure
    "/load_lora_adapter_from_tensors": {
        "lora_name": REQUIRED,
        "config_dict": REQUIRED,
        "serialized_named_tensors": REQUIRED,
        "pinned": False,
        "load_format": None,
        "expected_checksums": None,
    },
    # io_struct.UnloadLoRAAdapterReqInput; answered like the load
    "/unload_lora_adapter": {"lora_name": REQUIRED},
    # io_struct.EmbeddingReqInput (http_server.py::classify_request): text or input_ids, one prompt or a batch;
    # normalize_batch_and_arguments refuses neither or both, and sets sampling_params' max_new_tokens to 0
    "/classify": {"text": None, "input_ids": None, "rid": None, "sampling_params": None},
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
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/classify": "EmbeddingReqInput",
}
"""The `srt/managers/io_struct.py` class each path's body is; tests/dist/test_sglang_contract.py reads those
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

PAUSE_MODES = ("abort", "retract", "in_place")
"""io_struct.PauseGenerationReqInput.mode: abort (running requests end with their partial output) | retract (they
go back to the queue, their KV freed, and are prefilled again after continue) | in_place (they keep their KV)."""

ABORTED = "Aborted"
"""finish_reason.message of a running request aborted (schedule_batch.py::FINISH_ABORT's default)."""
ABORTED_WAITING = "Abort in waiting queue"
"""finish_reason.message of a queued request aborted (tokenizer_manager.py::_handle_abort_req)."""

INITIAL_WEIGHT_VERSION = "default"
"""The weight version an engine starts with (server_args.py `weight_version`)."""


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


def image_data_field(images: list[str], n: int) -> list[str] | list[list[str]]:
    """`image_data` of a one-prompt request with `images` (in prompt order): the list, or with n > 1 the list in a
    list, since SGLang then treats the request as a batch of one prompt and a flat list as one image per prompt
    (io_struct.py::GenerateReqInput._handle_parallel_sampling, _normalize_image_data)."""
    return list(images) if n == 1 else [list(images)]


def collapse_image_tokens(ids: list[int], image_token_id: int) -> list[int]:
    """`ids` with each run of `image_token_id` cut to one, the form SGLang's multimodal processor expands
    (base_processor.py::_expand_input_ids): the inverse of megarl.data.images.expand_image_tokens."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


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
        return {"type": "abort", "message": self.message, "status_code": None, "err_type": None}  # FINISH_ABORT.to_json


@dataclass(kw_only=True, slots=True)
class WeightVersionSpan:
    """Output tokens [start, end) were sampled with the weights of `version` (srt/utils/weight_versions.py)."""

    version: str
    start: int
    end: int


def version_spans(events: list[tuple[str, int]], current: str, num_tokens: int) -> list[WeightVersionSpan]:
    """The spans of `num_tokens` output tokens, given (old version, output tokens at the switch) for each version
    change during the request and the version it finished under (weight_versions.py::compute_weight_version_spans:
    switches at or before the previous one are skipped, a repeated version extends its span)."""
    spans: list[WeightVersionSpan] = []
    for version, count in [*events, (current, num_tokens)]:
        end = min(count, num_tokens)
        if spans and end <= spans[-1].end:
            continue
        if spans and spans[-1].version == version:
            spans[-1].end = end
        else:
            spans.append(WeightVersionSpan(version=version, start=spans[-1].end if spans else 0, end=end))
    return spans


def version_number(version: str | None) -> int:
    """The trainer step whose weights `version` names: "v12" → 12 (the trainer tags weights f"v{step}"); SGLang's
    initial "default", or None, → 0 (engines start from the step-0 weights)."""
    if version is None or version == INITIAL_WEIGHT_VERSION:
        return 0
    match = re.fullmatch(r"v([0-9]+)", version)
    if match is None:
        raise ValueError(f"weight version {version!r} is neither megarl's v<step> nor SGLang's initial 'default'")
    return int(match.group(1))


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
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    """Which weights sampled which output tokens, in order, covering all of them (meta_info.weight_versions)."""
    num_retractions: int = 0
    """Times the engine retracted the request (a pause in retract mode, or KV pressure in SGLang)."""
    num_resumes: int = 0
    """Times the router resubmitted it after an abort (`Router(resume_aborted=True)`)."""
    routed_experts: torch.Tensor | None = None
    """R3 routing: a CPU int32 tensor [rows, num_hidden_layers * num_experts_per_tok], the experts each layer's
    router picked (its top-k, in the router's order) for the tokens the engine forwarded. Row r is position
    `routed_experts_start_len + r` of prompt ‖ output_ids; rows = prompt_tokens + len(output_ids) - 1 -
    routed_experts_start_len, since the last output token is never forwarded. Within a row, layer l's ids are at
    [l * k, (l + 1) * k); dense layers are all 0. `.view(rows, num_hidden_layers, num_experts_per_tok)` gives
    SGLang's [token, layer, top_k] (`srt/state_capturer/base.py`); with no rows the shape is [0, 0]. Prompt tokens
    taken from the prefix cache carry the routing of the forward that computed them. None unless requested
    with `return_routed_experts`, the engine was started with `--enable-return-routed-experts`, and the
    request ran (one aborted in the waiting queue has none)."""
    routed_experts_start_len: int = 0
    """The request's `routed_experts_start_len`: the prompt position of row 0 of `routed_experts`."""
    output_token_ids_logprobs: list[dict[int, float]] | None = None
    """Per output position, {id: log-prob} of the ids named in `token_ids_logprob`, at the sampling temperature; None
    unless the request named some with return_logprob (tokenizer_manager.py::add_logprob_to_meta_info)."""

    def token_versions(self) -> list[int]:
        """The version number (`version_number`) of each output token."""
        versions = [version_number(s.version) for s in self.weight_versions for _ in range(s.start, s.end)]
        assert len(versions) == len(self.output_ids), "weight_versions cover every output token"
        return versions

    def extended(self, more: "GenerateResult") -> "GenerateResult":
        """This aborted partial result followed by `more`, its continuation (prompt + these tokens resubmitted):
        one result with the tokens, log-probs and version spans joined, ending as `more` ended."""
        offset = len(self.output_ids)
        spans = [dataclasses.replace(s) for s in self.weight_versions if s.end > s.start]
        for s in more.weight_versions:
            if s.end == s.start:
                continue
            if spans and spans[-1].version == s.version:
                spans[-1].end = s.end + offset
            else:
                spans.append(WeightVersionSpan(version=s.version, start=s.start + offset, end=s.end + offset))
        logprobs = None
        if self.output_logprobs is not None and more.output_logprobs is not None:
            logprobs = self.output_logprobs + more.output_logprobs
        return dataclasses.replace(
            self,
            output_ids=self.output_ids + more.output_ids,
            output_logprobs=logprobs,
            finish_reason=more.finish_reason,
            weight_version=more.weight_version,
            weight_versions=spans or more.weight_versions,
            num_retractions=self.num_retractions + more.num_retractions,
            num_resumes=self.num_resumes + 1,
            routed_experts=self._joined_routing(more),
            output_token_ids_logprobs=_joined(self.output_token_ids_logprobs, more.output_token_ids_logprobs),
        )

    @property
    def next_routed_experts_start_len(self) -> int:
        """The `routed_experts_start_len` a continuation (prompt + output_ids resubmitted) asks for, so that its
        rows start where this result's end."""
        held = 0 if self.routed_experts is None else len(self.routed_experts)
        return self.routed_experts_start_len + held

    def _joined_routing(self, more: "GenerateResult") -> torch.Tensor | None:
        """This result's routing rows followed by those of `more`, asked from `next_routed_experts_start_len`."""
        if self.routed_experts is None or more.routed_experts is None:
            return self.routed_experts if more.routed_experts is None else more.routed_experts
        assert more.prompt_tokens == self.prompt_tokens + len(self.output_ids), "the continuation's prompt"
        assert more.routed_experts_start_len == self.next_routed_experts_start_len, "its rows follow on from ours"
        parts = [r for r in (self.routed_experts, more.routed_experts) if len(r)]
        return torch.cat(parts) if parts else self.routed_experts

    @classmethod
    def from_json(
        cls, obj: dict[str, Any], num_input_tokens: int, routed_experts_start_len: int = 0
    ) -> "GenerateResult":
        """One reply element; `num_input_tokens` stands in for `prompt_tokens`, which SGLang leaves out when it
        aborts a request still in its waiting queue (tokenizer_manager.py::_handle_abort_req);
        `routed_experts_start_len` is the request's."""
        meta = obj["meta_info"]
        entries = meta.get("output_token_logprobs")
        output_ids = list(obj["output_ids"])
        version = meta.get("weight_version")
        whole = {"version": version or INITIAL_WEIGHT_VERSION, "start": 0, "end": len(output_ids)}
        spans = meta.get("weight_versions") or [whole]
        return cls(
            rid=meta["id"],
            output_ids=output_ids,
            output_logprobs=None if entries is None else [_logprob(e[0]) for e in entries],
            finish_reason=FinishReason.from_json(meta["finish_reason"]),
            prompt_tokens=int(meta.get("prompt_tokens", num_input_tokens)),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=version,
            weight_versions=[WeightVersionSpan(**span) for span in spans],
            num_retractions=int(meta.get("num_retractions", 0)),
            routed_experts=_routing(meta, len(output_ids), num_input_tokens, routed_experts_start_len),
            routed_experts_start_len=routed_experts_start_len,
            output_token_ids_logprobs=[  # one list of [logprob, id, text] per position (null = none)
                {int(e[1]): _logprob(e[0]) for e in entries or []} for entries in meta["output_token_ids_logprobs"]
            ]
            if "output_token_ids_logprobs" in meta
            else None,
        )


def _routing(meta: dict[str, Any], num_output: int, num_input_tokens: int, start_len: int) -> torch.Tensor | None:
    """`meta_info.routed_experts` as [rows, layers * top_k]: base64 of the int32 [rows, layers, top_k] array's
    bytes (detokenizer_manager.py::_b64_encode_per_request); rows as batch_result_processor.py::
    _maybe_collect_routed_experts counts them, start_len clamped to seqlen - 1 like base.py::get_topk."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        return None
    raw = bytearray(base64.b64decode(encoded))  # "" when there are no rows
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    seqlen = int(meta.get("prompt_tokens", num_input_tokens)) + num_output
    rows = seqlen - 1 - min(start_len, seqlen - 1)
    if rows == 0 and not flat.numel():
        return flat.view(0, 0)
    if rows == 0 or not flat.numel() or flat.numel() % rows:
        raise ValueError(f"meta_info.routed_experts: {flat.numel()} ids for {rows} rows (prompt + output - 1 - start)")
    return flat.view(rows, -1)


def _joined(first: list | None, then: list | None) -> list | None:
    """Per-position lists of a result and its continuation joined; None unless both have them."""
    return None if first is None or then is None else first + then


def _logprob(value: float | None) -> float:
    """Log-prob entries are null for -inf (tokenizer_manager.detokenize_logprob_tokens)."""
    return float("-inf") if value is None else float(value)
