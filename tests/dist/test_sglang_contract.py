"""megarl's engine boundary checked against SGLang 0.5.23's own code, on CPU.

The SGLang side runs in subprocesses (tests/cases/sglang_side.py) from the pinned wheel installed without
its GPU dependencies (tests/cases/sglang_env.py, cached outside the clone). Checked: every command line
megarl builds parses in `prepare_server_args` to the intended fields;
megarl's weight-update group meets SGLang's `init_custom_process_group` and a broadcast arrives
intact, per tensor and flattened; megarl's tensor payloads decode through SGLang's serializer and
allow-list; the flattened layout agrees; request bodies match SGLang's request structs; the pause modes and
the abort finish reason are SGLang's; weight-version spans agree with SGLang's own functions.
"""

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cases.sglang_env import finish_side, run_side, sglang_file, sglang_site, start_side
from conftest import compose_config
from torch.multiprocessing import reductions

from megarl.assets import asset_path
from megarl.config import ConfigError
from megarl.engines.client import sglang_api
from megarl.engines.client.auth import EngineKeys
from megarl.engines.embedded.__main__ import parse_args as embedded_parse_args
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.requests import response
from megarl.engines.embedded.sampler import RowSampling
from megarl.engines.replicas.launch import LoraServing, engine_layout, sglang_base_args
from megarl.engines.replicas.sglang_command import LOOPBACK, SGLangServerArgs, replica_node_args, sglang_command
from megarl.engines.weights.tensor_handles import (
    ALLOWED_GLOBALS,
    DEVICE_ARG,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megarl.engines.weights.weight_group import broadcast, close_weight_group, flat_offsets, init_weight_group
from megarl.plan.gate import validate
from megarl.ports import free_port

pytestmark = pytest.mark.slow
MODEL = str(asset_path("models/tiny_dense"))


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


def _argv(args: SGLangServerArgs) -> list[str]:
    return sglang_command(args)[3:]  # after `python -m sglang.launch_server`


def _intended(args: SGLangServerArgs) -> dict[str, Any]:
    """The ServerArgs fields `args` sets on the command line (None and False are left to SGLang)."""
    typed = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "extra"}
    return {k: v for k, v in typed.items() if v is not None and v is not False} | args.extra


def _command_lines() -> list[SGLangServerArgs]:
    """One node of a one-node replica, every node of a two-node replica, extra kwargs of each kind, LoRA serving."""
    cfg = compose_config(
        "rollout=sglang",
        f"model.path={MODEL}",
        "rollout.tensor_parallel_size=2",
        "rollout.expert_parallel_size=2",
        "rollout.load_format=dummy",
        "rollout.dtype=bfloat16",
        "rollout.attention_backend=triton",
        "rollout.return_routed_experts=true",
        "+rollout.engine_kwargs.chunked_prefill_size=8192",
        "+rollout.engine_kwargs.enable_metrics=true",
        "+rollout.engine_kwargs.cuda_graph_bs_decode=[1,2,4]",
    )
    keys, lora = EngineKeys(api="k", admin="a"), LoraServing(max_rank=16, target_modules=("all-linear",))
    base = dataclasses.replace(sglang_base_args(cfg.rollout, cfg.model, LOOPBACK, keys, lora), nccl_port=29511)
    single = replica_node_args(base, engine_layout(cfg.rollout, 8, 8), 3, ["10.0.0.1"], 30011, 20011)
    wide = dataclasses.replace(base, tp_size=4, ep_size=1, extra={"max_prefill_tokens": 4096})
    spanning = replica_node_args(wide, engine_layout(dataclasses.replace(cfg.rollout, tensor_parallel_size=4), 4, 2),
                                 0, ["10.0.0.1", "10.0.0.2"], 30000, 20000)  # fmt: skip
    return [*single, *spanning]


def test_every_command_line_parses_in_sglang_to_the_intended_fields(site: Path) -> None:
    lines = _command_lines()
    assert [a.node_rank for a in lines] == [0, 0, 1] and lines[0].base_gpu_id == 6
    assert lines[0].lora_target_modules == ["all"] and lines[0].enable_lora
    fields = sorted(set().union(*(_intended(a) for a in lines)))
    answers = run_side(site, "server_args", {"argvs": [_argv(a) for a in lines], "fields": fields})
    for args, answer in zip(lines, answers, strict=True):
        assert "error" not in answer, (_argv(args), answer)
        parsed = answer["fields"]
        assert {k: parsed[k] for k in _intended(args)} == _intended(args)


def test_sglang_refuses_rollout_dp_where_validation_does(site: Path, data_overrides: list[str]) -> None:
    checks = sglang_file(site, "srt/arg_groups/validation_hook.py").read_text()
    assert "assert not (cfg.dp_size > 1 and cfg.nnodes != 1)" in checks  # check_server_args, at launch
    mixin = sglang_file(site, "srt/managers/tokenizer_control_mixin.py").read_text()
    for method in ("update_weights_from_tensor", "init_weights_update_group", "update_weights_from_distributed"):
        body = mixin.split(f"async def {method}(", 1)[1].split("async def ", 1)[0]
        assert "assert get_parallel().dp_size == 1" in body, method
    with pytest.raises(ConfigError, match="SGLang 0.5.23 takes weight updates only with --dp-size 1"):
        validate(compose_config("rollout=sglang", "rollout.data_parallel_size=2", *data_overrides))


BUCKET = {
    "model.layers.0.self_attn.qkv_proj.weight": torch.randn(6, 4),
    "model.layers.0.mlp.down_proj.weight": torch.randn(4, 5),
    "model.norm.weight": torch.randn(4),
}


def _packed(dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """BUCKET in `dtype` packed back to back into one buffer, as the sync executor packs a bucket."""
    tensors = {name: t.to(dtype) for name, t in BUCKET.items()}
    offsets, total = flat_offsets([t.dtype for t in tensors.values()], [list(t.shape) for t in tensors.values()])
    flat = torch.empty(total, dtype=torch.uint8)
    named = []
    for (name, tensor), start in zip(tensors.items(), offsets, strict=True):
        view = flat[start : start + tensor.numel() * tensor.element_size()].view(dtype).view(tensor.shape)
        view.copy_(tensor)
        named.append((name, view))
    return flat, named


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_megarl_group_meets_sglangs_and_the_bucket_arrives(site: Path, tmp_path: Path, load_format: str | None) -> None:
    flat, named = _packed(torch.bfloat16)
    port, name = free_port(), "megarl-sync-rank0"
    names, shapes = [n for n, _ in named], [list(t.shape) for _, t in named]
    request = {
        "master_address": LOOPBACK, "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": name,
        "names": names, "dtypes": ["bfloat16"] * len(named), "shapes": shapes, "load_format": load_format,
        "out": str(tmp_path / "received.pt"),
    }  # fmt: skip
    engine = start_side(site, "receive", request)
    group = init_weight_group(LOOPBACK, port, 0, 2, name, "gloo", timeout_s=60)
    try:
        for tensor in [flat] if load_format == "flattened_bucket" else [t for _, t in named]:
            broadcast(group, tensor)
        answer = finish_side(engine, timeout_s=120)
    finally:
        close_weight_group(group)
    assert answer["ok"], answer
    received = torch.load(tmp_path / "received.pt")
    assert list(received) == [n for n, _ in named]
    for n, tensor in named:
        assert received[n].dtype == torch.bfloat16 and torch.equal(received[n], tensor), n


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_megarl_payloads_decode_in_sglang(site: Path, tmp_path: Path, load_format: str | None) -> None:
    flat, named = _packed(torch.float32)
    if load_format == "flattened_bucket":
        entries = [serialize_flattened_bucket(flat, named) for _ in range(2)]
    else:
        entries = [serialize_named_tensors(named) for _ in range(2)]
    request = {"entries": entries, "tp_rank": 1, "load_format": load_format, "out": str(tmp_path / "decoded.pt")}
    answer = run_side(site, "decode", request)
    decoded = torch.load(tmp_path / "decoded.pt")
    assert answer["names"] == list(decoded) == [n for n, _ in named]
    for n, tensor in named:
        assert torch.equal(decoded[n], tensor), n


def test_megarls_unpickler_allows_nothing_sglangs_refuses(site: Path) -> None:
    sglang_allowed = {tuple(pair) for pair in run_side(site, "allowed", {})}
    assert sglang_allowed >= ALLOWED_GLOBALS, sorted(ALLOWED_GLOBALS - sglang_allowed)


def test_handles_name_their_gpu_where_sglangs_receiver_reads_it(site: Path) -> None:
    """megarl's pickler puts the GPU's UUID in the argument SGLang's `_rebuild_cuda_tensor_modified` maps."""
    tree = ast.parse(sglang_file(site, "srt/utils/patch_torch.py").read_text())
    (index,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "_REDUCE_TENSOR_ARG_DEVICE_INDEX" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]
    assert index == DEVICE_ARG
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[DEVICE_ARG] == "storage_device"


LAYOUTS = [
    {"dtypes": ["bfloat16", "bfloat16"], "shapes": [[3, 5], [7]]},
    {"dtypes": ["float32", "bfloat16", "bfloat16"], "shapes": [[3], [1], [2, 2]]},
    {"dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]]},  # the float32 would start at byte 6
    {"dtypes": ["uint8", "int64"], "shapes": [[4], [1]]},
]


def test_flattened_offsets_agree_with_sglangs_bucket(site: Path) -> None:
    answers = run_side(site, "layout", {"cases": LAYOUTS})
    for case, answer in zip(LAYOUTS, answers, strict=True):
        dtypes = [getattr(torch, d) for d in case["dtypes"]]
        if "error" in answer:
            with pytest.raises(ValueError, match="not a multiple of its itemsize"):
                flat_offsets(dtypes, case["shapes"])
        else:
            assert list(flat_offsets(dtypes, case["shapes"])) == [answer["offsets"], answer["total"]], case
    assert [("error" in a) for a in answers] == [False, False, True, True]


def _struct_fields(source: str, name: str, seen: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """Field → default (`sglang_api.REQUIRED` when none) of class `name` in io_struct.py, bases first."""
    cls = seen[name]
    fields: dict[str, Any] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in seen:
            fields |= _struct_fields(source, base.id, seen)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.target.id] = _default(node.value)
    return fields


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return sglang_api.REQUIRED
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
        return _default(value) if value is not None else "<factory>"
    try:
        return ast.literal_eval(value)
    except ValueError:
        return f"<{ast.unparse(value)}>"


# Where megarl's default differs from the struct's field default: the line of SGLang's normalization
# that makes them the same request (checked to be in the file).
IO = "srt/managers/io_struct.py"
SAME_EFFECT = {
    ("/generate", "input_ids"): (IO, "self.text is None and self.input_ids is None and self.input_embeds is None"),
    ("/generate", "return_logprob"): (IO, "self.return_logprob = False"),
    ("/generate", "logprob_start_len"): (IO, "self.logprob_start_len = -1"),
    ("/generate", "top_logprobs_num"): (IO, "self.top_logprobs_num = 0"),
    ("/abort_request", "rid"): (IO, 'self.rid = ""'),
    ("sampling_params", "top_k"): ("srt/sampling/sampling_params.py", "self.top_k = TOP_K_ALL"),
}


def _routes(source: str) -> dict[str, str]:
    """Path → the body annotation of its handler, for every `@app.<method>(path)` in http_server.py."""
    routes = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).startswith("app.") and deco.args):
                    continue
                if isinstance(deco.args[0], ast.Constant) and node.args.args:
                    first = node.args.args[0].annotation
                    routes[deco.args[0].value] = "" if first is None else ast.unparse(first)
    return routes


def test_request_bodies_match_sglangs_request_structs(site: Path) -> None:
    for file, line in SAME_EFFECT.values():
        assert line in sglang_file(site, file).read_text(), (file, line)
    source = sglang_file(site, "srt/managers/io_struct.py").read_text()
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    routes = _routes(sglang_file(site, "srt/entrypoints/http_server.py").read_text())
    for path, fields in sglang_api.REQUEST_FIELDS.items():
        assert sglang_api.REQUEST_STRUCTS[path] in routes[path], (path, routes.get(path))
        theirs = _struct_fields(source, sglang_api.REQUEST_STRUCTS[path], classes)
        assert set(fields) <= set(theirs), (path, sorted(set(fields) - set(theirs)))
        for key, default in fields.items():
            if (path, key) not in SAME_EFFECT:
                assert theirs[key] == default, (path, key, theirs[key], default)
    sampling_source = sglang_file(site, "srt/sampling/sampling_params.py").read_text()
    sampling = {n.name: n for n in ast.walk(ast.parse(sampling_source)) if isinstance(n, ast.ClassDef)}
    theirs = _struct_fields(sampling_source, "SamplingParams", sampling)
    assert set(sglang_api.SAMPLING_FIELDS) <= set(theirs), sorted(set(sglang_api.SAMPLING_FIELDS) - set(theirs))
    for key, default in sglang_api.SAMPLING_FIELDS.items():
        if ("sampling_params", key) not in SAME_EFFECT:
            assert theirs[key] == default, (key, theirs[key], default)


def test_contract_runner_reports_a_refused_command_line(site: Path) -> None:
    [answer] = run_side(site, "server_args", {"argvs": [["--model-path", MODEL, "--no-such-flag", "1"]], "fields": []})
    assert "SystemExit" in answer["error"]


def _class(source: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)


def test_pause_modes_and_abort_finish_reasons_are_sglangs(site: Path) -> None:
    io = sglang_file(site, IO).read_text()
    (mode,) = [n for n in _class(io, "PauseGenerationReqInput").body if isinstance(n, ast.AnnAssign)]
    assert ast.unparse(mode.target) == "mode" and isinstance(mode.annotation, ast.Subscript)
    assert ast.unparse(mode.annotation.value) == "Literal"
    assert ast.literal_eval(mode.annotation.slice) == sglang_api.PAUSE_MODES
    batch = sglang_file(site, "srt/managers/schedule_batch.py").read_text()
    finish_abort = _class(batch, "FINISH_ABORT")
    (to_json,) = [n for n in finish_abort.body if isinstance(n, ast.FunctionDef) and n.name == "to_json"]
    (returned,) = [n.value for n in ast.walk(to_json) if isinstance(n, ast.Return)]
    assert isinstance(returned, ast.Dict)
    keys = [ast.literal_eval(k) for k in returned.keys if k is not None]
    assert keys == list(sglang_api.FinishReason(type="abort", message=sglang_api.ABORTED).to_json())
    assert f'message or "{sglang_api.ABORTED}"' in ast.unparse(finish_abort).replace("'", '"')
    tokenizer_manager = sglang_file(site, "srt/managers/tokenizer_manager.py").read_text()
    assert f'abort_message = recv_obj.abort_message or "{sglang_api.ABORTED_WAITING}"' in tokenizer_manager


SPAN_CASES = [
    {"events": [], "current": "default", "num_tokens": 5},
    {"events": [["default", 3]], "current": "v1", "num_tokens": 5},
    {"events": [["default", 3], ["v1", 3]], "current": "v2", "num_tokens": 6},  # two updates between tokens
    {"events": [["v1", 2], ["v2", 4]], "current": "v1", "num_tokens": 6},  # back to an earlier version
    {"events": [["v1", 2], ["v1", 4]], "current": "v2", "num_tokens": 6},  # a version label set twice
    {"events": [["v1", 4]], "current": "v2", "num_tokens": 4},  # an update after the last token
    {"events": [["v1", 9]], "current": "v2", "num_tokens": 5},  # more tokens then than returned
    {"events": [], "current": "v3", "num_tokens": 0},
]
SPANS = """
import json, sys
sys.path.append(sys.argv[1])
from sglang.srt.utils.weight_versions import (
    WeightVersionEvent, add_weight_versions_to_meta_info, compute_weight_version_spans)
answers = []
for case in json.load(sys.stdin):
    events = [WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in case["events"]]
    spans = compute_weight_version_spans(events, case["current"], case["num_tokens"])
    meta = {}
    add_weight_versions_to_meta_info(meta, spans, case["num_tokens"])
    answers.append(meta)
print(json.dumps(answers))
"""


def test_weight_version_spans_match_sglangs_functions(site: Path) -> None:
    """megarl's spans (the embedded engine's reply, joined by the router) against weight_versions.py's own
    compute_weight_version_spans + add_weight_versions_to_meta_info, run from the wheel."""
    command = [sys.executable, "-c", SPANS, str(site)]
    done = subprocess.run(
        command, input=json.dumps(SPAN_CASES), capture_output=True, text=True, timeout=180, check=True
    )
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for case, theirs in zip(SPAN_CASES, answers, strict=True):
        ours = sglang_api.version_spans([tuple(e) for e in case["events"]], case["current"], case["num_tokens"])
        assert [dataclasses.asdict(span) for span in ours] == theirs["weight_versions"], case
        assert ours[-1].version == theirs["weight_version"], case


ROUTED_EXPERTS = """
import ast, json, sys
sys.path.append(sys.argv[1])
import numpy as np, pybase64
source = sys.argv[1] + "/sglang/srt/state_capturer/routed_experts.py"
name = "extract_routed_experts_from_meta_info"
tree = ast.parse(open(source).read())
[fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
namespace = {"np": np, "pybase64": pybase64}
exec(compile(ast.Module(body=[fn], type_ignores=[]), source, "exec"), namespace)
print(json.dumps([namespace[name](reply).tolist() for reply in json.load(sys.stdin)]))
"""
ROUTED_ROWS = {
    # how many rows SGLang returns, and from where (the megarl side: sglang_api._routing, requests._routed_rows)
    "srt/managers/scheduler_components/batch_result_processor.py": "expected_rows = max(0, seqlen - 1 - start_len)",
    "srt/state_capturer/base.py": "start_len = min(start_len, seqlen - 1)",
    "srt/managers/detokenizer_manager.py": 'pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")',
    "srt/managers/scheduler.py": "if recv_req.routed_experts_start_len > len(req.origin_input_ids):",
}


def test_routed_experts_replies_decode_with_sglangs_extractor(site: Path) -> None:
    """The embedded engine's meta_info.routed_experts, decoded by SGLang's own extract_routed_experts_from_meta_info
    (compiled from its text: the module imports CUDA-side layers), holds the engine's rows in [token, layer, top_k]
    order, and the client reads the same rows; SGLang's row count, encoding and start_len check are what megarl
    mirrors; the engines' launch flag is SGLang's (the command lines above parse it)."""
    for file, line in ROUTED_ROWS.items():
        assert line in sglang_file(site, file).read_text(), (file, line)
    routing = torch.randint(0, 64, (3 + 4 - 1, 5, 2), dtype=torch.int32)  # prompt 3 + output 4 - 1 rows
    sampling = RowSampling(temperature=1.0, top_p=1.0, top_k=-1, generator=None)
    replies = []
    for start in (0, 2, 3):
        seq = Sequence(rid=f"r{start}", prompt=[1, 2, 3], sampling=sampling, max_new_tokens=4, stop_ids=frozenset(),
                       output=[4, 5, 6, 7], routed_experts_start_len=start, routing=[routing[:4], routing[4:]],
                       finish=sglang_api.FinishReason(type="length", length=4),
                       version_spans=[sglang_api.WeightVersionSpan(version="default", start=0, end=4)])  # fmt: skip
        replies.append(response(seq, return_logprob=False, started=0.0))
    command = [sys.executable, "-c", ROUTED_EXPERTS, str(site)]
    done = subprocess.run(command, input=json.dumps(replies), capture_output=True, text=True, timeout=180, check=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for start, reply, flat in zip((0, 2, 3), replies, theirs, strict=True):
        assert flat == routing[start:].flatten().tolist()
        ours = sglang_api.GenerateResult.from_json(reply, 3, routed_experts_start_len=start).routed_experts
        assert ours is not None and torch.equal(ours.view(-1, 5, 2), routing[start:])
    embedded = embedded_parse_args(["--model-path", MODEL, "--enable-return-routed-experts"])
    assert embedded.enable_return_routed_experts
