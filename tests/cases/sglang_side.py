"""SGLang 0.5.23's side of megarl's engine boundary, run from SGLang's own code on CPU.

`python tests/cases/sglang_side.py SITE COMMAND` reads a JSON request on stdin and prints one JSON line.
SITE holds the sglang wheel installed without its GPU dependencies (tests/cases/sglang_env.py); it is
appended to sys.path, so the venv's packages win. Commands:

- server_args: parse each argv with `server_args.prepare_server_args` (parse, `from_cli_args`,
  `__post_init__`). Launch then resolves and checks the fields, which needs torchvision and the model
  config; tests read those checks from the source instead.
- receive: join a weight-update group as an engine TP rank and receive one update, per tensor or flattened.
- decode: decode a `serialized_named_tensors` entry as a TP rank of `update_weights_from_tensor` does.
- layout: `FlattenedTensorBucket.empty`'s byte offsets for dtype/shape lists, or its refusal.
- allowed: `SafeUnpickler.ALLOWED_GLOBALS`.
- classify: parse each argv as `server_args` does, and take each `/classify` body as SGLang does (http_server.py::
  classify_request): validated into `io_struct.EmbeddingReqInput` by pydantic as FastAPI does, then
  `normalize_batch_and_arguments`; the class is compiled from io_struct.py's text (`embedding_request_class`).
- lora: take a `/load_lora_adapter_from_tensors` body as a TP rank does: the HTTP layer's base64 decode, the
  tokenizer's normalization, then `BaseTpWorker.load_lora_adapter_from_tensors`, whose model runner here parses the
  config as the LoRA manager does (`LoRAConfig.from_dict`) and keeps the tensors.
- generate_images: `/generate` bodies with image_data through `GenerateReqInput` (compiled like EmbeddingReqInput)
  and its `normalize_batch_and_arguments`: the images each sample gets.
- openai_chat: chat-completion bodies through SGLang's OpenAI `ChatCompletionRequest`, and megarl's session-server
  answers through its `ChatCompletionResponse` / `ChatCompletionStreamResponse`.

The weight-update methods live in `srt/model_executor/model_runner_components/weight_updater.py`,
which does not import on CPU (torchvision, CUDA kernels), and so does `srt/managers/tp_worker.py`.
`compiled_methods` compiles the methods used from such a file's text, unchanged, into a class: `EngineRank`, a
host with the fields they read, and `TpWorker`.
"""

import __future__

import ast
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SITE = Path(sys.argv[1])
sys.path.append(str(SITE))

from sglang.srt.lora.lora_config import LoRAConfig  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils.common import (  # noqa: E402
    MultiprocessingSerializer,
    SafeUnpickler,
    init_custom_process_group,
    normalize_serialized_named_tensor_payloads,
)
from sglang.srt.utils.msgspec_utils import Base64Bytes  # noqa: E402
from sglang.srt.utils.network import NetworkAddress  # noqa: E402
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: E402
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata  # noqa: E402

UPDATER = SITE / "sglang/srt/model_executor/model_runner_components/weight_updater.py"
METHODS = (
    "init_weights_update_group",
    "destroy_weights_update_group",
    "receive_weights_from_distributed",
    "_receive_bucketed_weights_from_distributed",
    "_update_weights_from_flattened_bucket",
)
TP_WORKER = SITE / "sglang/srt/managers/tp_worker.py"
TP_WORKER_METHODS = ("deserialize_own_rank", "load_lora_adapter_from_tensors")


def compiled_methods(
    path: Path, class_name: str, methods: tuple[str, ...], namespace: dict[str, Any]
) -> dict[str, Any]:
    """Class `class_name`'s `methods`, compiled from `path`'s text with `namespace` as their globals."""
    tree = ast.parse(path.read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    defs = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in methods]
    missing = set(methods) - {node.name for node in defs}
    if missing:
        raise SystemExit(f"{path} has no {class_name}.{sorted(missing)}")
    code = compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec", __future__.annotations.compiler_flag)
    namespace = {"torch": torch, "logger": logging.getLogger("sglang_side"), **namespace}
    exec(code, namespace)
    return {name: namespace[name] for name in methods}


def updater_methods() -> dict[str, Any]:
    """`WeightUpdater`'s methods named in METHODS, compiled from weight_updater.py's text."""
    namespace = {
        "NetworkAddress": NetworkAddress,
        "init_custom_process_group": init_custom_process_group,
        "FlattenedTensorBucket": FlattenedTensorBucket,
        "FlattenedTensorMetadata": FlattenedTensorMetadata,
    }
    return compiled_methods(UPDATER, "WeightUpdater", METHODS, namespace)


class RecordingModel:
    """Stands for the model: keeps a copy of what `load_weights` receives."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update({name: tensor.clone() for name, tensor in named})


EngineRank = type("EngineRank", (), updater_methods())
"""An engine TP rank: the fields the compiled methods read are set per instance (`engine_rank`)."""


def engine_rank(tp_rank: int = 0) -> Any:
    rank = EngineRank()
    rank.tp_rank, rank.device, rank._model_update_group = tp_rank, "cpu", {}
    model = RecordingModel()
    rank.get_model = lambda: model
    return rank


def server_args(request: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for argv in request["argvs"]:
        try:
            args = prepare_server_args(argv)
        except (AssertionError, ValueError, SystemExit) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"fields": {name: getattr(args, name) for name in request["fields"]}})
    return out


def receive(request: dict[str, Any]) -> dict[str, Any]:
    # SGLang's scheduler process always has its default (TP) group; init_weights_update_group asserts it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = engine_rank()
    ok, message = rank.init_weights_update_group(
        request["master_address"], request["master_port"], request["rank_offset"], request["world_size"],
        request["group_name"], backend="gloo",
    )  # fmt: skip
    if not ok:
        return {"ok": False, "message": message}
    named = rank.receive_weights_from_distributed(
        names=request["names"], dtypes=request["dtypes"], shapes=request["shapes"],
        group_name=request["group_name"], load_format=request["load_format"],
    )  # fmt: skip
    torch.save({name: tensor.clone() for name, tensor in named}, request["out"])
    ok, message = rank.destroy_weights_update_group(request["group_name"])
    return {"ok": ok, "message": message}


def decode(request: dict[str, Any]) -> dict[str, Any]:
    monkey_patch_torch_reductions()  # as tp_worker.py::deserialize_own_rank does before decoding
    rank = engine_rank(request["tp_rank"])
    payload = MultiprocessingSerializer.deserialize(request["entries"][request["tp_rank"]])
    if request["load_format"] == "flattened_bucket":
        rank._update_weights_from_flattened_bucket(flattened_tensor_bucket_dict=payload)
    else:
        rank.get_model().load_weights(payload)
    torch.save(rank.get_model().loaded, request["out"])
    return {"ok": True, "names": list(rank.get_model().loaded)}


class RecordingRunner:
    """Stands for the model runner of `load_lora_adapter_from_tensors`: parses the config as lora_manager.py's
    `_load_lora_adapter_from_tensors` does and keeps a copy of the tensors."""

    def load_lora_adapter_from_tensors(
        self, ref: Any, tensors: dict[str, torch.Tensor], config_dict: dict[str, Any], added_tokens: Any
    ) -> None:
        self.config = LoRAConfig.from_dict(config_dict, added_tokens, base_vocab_size=None)
        self.tensors = {name: tensor.clone() for name, tensor in tensors.items()}


def lora(request: dict[str, Any]) -> dict[str, Any]:
    body = request["body"]
    parallel = types.SimpleNamespace(tp_rank=request["tp_rank"])
    namespace = {
        "MultiprocessingSerializer": MultiprocessingSerializer,
        "monkey_patch_torch_reductions": monkey_patch_torch_reductions,
        "FlattenedTensorBucket": FlattenedTensorBucket,
        "get_parallel": lambda: parallel,
    }
    worker = type("TpWorker", (), compiled_methods(TP_WORKER, "BaseTpWorker", TP_WORKER_METHODS, namespace))()
    worker.model_runner = RecordingRunner()
    entries = Base64Bytes._decode_value(body["serialized_named_tensors"])  # the HTTP layer (Base64Bytes)
    defaults = {"pinned": False, "added_tokens_config": None, "load_format": None, "expected_checksums": None}
    normalized = normalize_serialized_named_tensor_payloads(entries)  # tokenizer_control_mixin.py
    recv = types.SimpleNamespace(**{**defaults, **body, "serialized_named_tensors": normalized}, to_ref=lambda: None)
    worker.load_lora_adapter_from_tensors(recv)
    runner = worker.model_runner
    torch.save(runner.tensors, request["out"])
    config = runner.config
    return {"r": config.r, "lora_alpha": config.lora_alpha, "target_modules": sorted(config.target_modules)}


def layout(request: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for case in request["cases"]:
        names = [f"t{i}" for i in range(len(case["dtypes"]))]
        try:
            bucket = FlattenedTensorBucket.empty(names, case["dtypes"], case["shapes"], "cpu")
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        metadata = bucket.get_metadata()
        out.append({"offsets": [m.start_idx for m in metadata], "total": bucket.get_flattened_tensor().numel()})
    return out


def allowed(request: dict[str, Any]) -> list[list[str]]:
    return sorted([module, name] for module, name in SafeUnpickler.ALLOWED_GLOBALS)


IO_STRUCT = SITE / "sglang/srt/managers/io_struct.py"


def request_class(name: str) -> type:
    """io_struct.py's class `name` (EmbeddingReqInput, GenerateReqInput), compiled unchanged from the file's text
    (which does not import on CPU) into a module of its own, so pydantic resolves its annotations there; the
    multimodal input types stand as Any, and schedule_batch.py's `get_return_hidden_states_mode` (a validator of
    return_hidden_states, which megarl never sets) as a no-op."""
    import dataclasses
    import typing
    import uuid
    from collections import Counter

    tree = ast.parse(IO_STRUCT.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    module = types.ModuleType(f"sglang_side_{name}")
    module.__dict__.update({name: getattr(typing, name) for name in ("Any", "Dict", "List", "Optional", "Union")})
    module.__dict__.update(dataclass=dataclasses.dataclass, field=dataclasses.field, uuid=uuid, Counter=Counter)
    module.__dict__.update(MultimodalDataInputFormat=Any, PositionalEmbeds=Any)
    module.__dict__.update(get_return_hidden_states_mode=lambda mode: None)
    sys.modules[module.__name__] = module
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(IO_STRUCT), "exec", flags), module.__dict__)
    return module.__dict__[name]


def classify(request: dict[str, Any]) -> dict[str, Any]:
    import pydantic

    adapter = pydantic.TypeAdapter(request_class("EmbeddingReqInput"))
    out = []
    for body in request["bodies"]:
        try:
            obj = adapter.validate_python(body)
            obj.normalize_batch_and_arguments()
        except (pydantic.ValidationError, ValueError, AssertionError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        fields = ("batch_size", "is_single", "rid", "text", "input_ids", "sampling_params")
        out.append({name: getattr(obj, name) for name in fields})
    return {"server_args": server_args(request), "requests": out}


def generate_images(request: dict[str, Any]) -> list[Any]:
    """Each `/generate` body through `GenerateReqInput.normalize_batch_and_arguments`: the image_data each sample
    ends up with (`__getitem__` per sample of a batch), or the refusal."""
    cls = request_class("GenerateReqInput")
    out: list[Any] = []
    for body in request["bodies"]:
        obj = cls(**body)
        try:
            obj.normalize_batch_and_arguments()
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        samples = [obj] if obj.is_single else [obj[i] for i in range(len(obj.image_data))]
        out.append({"samples": [sample.image_data for sample in samples]})
    return out


def openai_chat(request: dict[str, Any]) -> dict[str, Any]:
    """Chat-completion bodies as SGLang's OpenAI server takes them (`srt/entrypoints/openai/protocol.py`
    ChatCompletionRequest, validated by pydantic as FastAPI does), and whether megarl's completions and stream
    chunks validate as its ChatCompletionResponse / ChatCompletionStreamResponse."""
    import pydantic
    from sglang.srt.entrypoints.openai import protocol

    out = []
    for body in request["requests"]:
        try:
            obj = protocol.ChatCompletionRequest.model_validate(body)
        except pydantic.ValidationError as e:
            out.append({"error": str(e)})
            continue
        fields = ("stop", "tool_choice", "temperature", "top_p", "logprobs", "stream", "n")
        limit = obj.to_sampling_params([], {})["max_new_tokens"]  # max_completion_tokens, else max_tokens
        out.append({name: getattr(obj, name) for name in fields} | {"max_new_tokens": limit})
    checks = {"responses": protocol.ChatCompletionResponse, "chunks": protocol.ChatCompletionStreamResponse}
    valid = {key: [_validates(model, body) for body in request[key]] for key, model in checks.items()}
    return {"requests": out} | valid


def _validates(model: Any, body: dict[str, Any]) -> str:
    try:
        model.model_validate(body)
    except Exception as e:  # pydantic's ValidationError, or a model validator's own error
        return f"{type(e).__name__}: {e}"
    return "ok"


COMMANDS = {
    "server_args": server_args,
    "receive": receive,
    "decode": decode,
    "layout": layout,
    "allowed": allowed,
    "lora": lora,
    "classify": classify,
    "openai_chat": openai_chat,
    "generate_images": generate_images,
}

if __name__ == "__main__":
    print(json.dumps(COMMANDS[sys.argv[2]](json.load(sys.stdin))))
