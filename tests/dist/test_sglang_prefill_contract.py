"""megarl's prefill scoring (the distillation teacher's `/generate` with max_new_tokens 0 and logprob_start_len)
checked against SGLang 0.5.23's own code, on CPU.

One side process runs, from the pinned wheel (tests/cases/sglang_env.py): SGLang's `GenerateReqInput` (compiled
unchanged from io_struct.py's text, validated by pydantic as FastAPI does, then `normalize_batch_and_arguments`) and
its `SamplingParams` (normalize, verify) on the bodies `prefill_body` builds; and the scheduler's and tokenizer
manager's own input log-prob bookkeeping (`_process_input_token_logprobs`, `_process_input_top_logprobs`,
`detokenize_logprob_tokens`, `detokenize_top_logprobs_tokens`) on per-position numbers, whose entries must equal
the embedded engine's reply built from the same numbers, and which `scored_log_probs` reads back aligned. The side
process imports no `sglang/__init__.py` (that pulls in the whole runtime): the modules it imports for real are
reached through bare package objects.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cases.sglang_env import sglang_file, sglang_site

from megarl.engines.client.prefill_api import prefill_body, scored_log_probs
from megarl.engines.client.sglang_api import FinishReason, WeightVersionSpan
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.requests import response
from megarl.engines.embedded.sampler import RowSampling

pytestmark = pytest.mark.slow
VOCAB = 50
SIDE = r"""
import ast, json, sys, types, typing, uuid, copy, warnings, dataclasses, collections, __future__
import pydantic

site = sys.argv[1]
sys.path.append(site)  # the wheel and its pure dependencies (msgspec, ...); the venv's packages win
for name in ("sglang", "sglang.srt.utils"):  # their __init__ imports the whole runtime (CUDA kernels, torchvision)
    package = types.ModuleType(name)
    package.__path__ = [site + "/" + name.replace(".", "/")]
    sys.modules[name] = package
from sglang.srt.managers.kv_hints import KvHintsEnvelope, decode_kv_hints_envelope
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.field_validators import validate_optional_list_i64_1d_2d


def compiled(relative, names, module, classname=None):
    # `names` (top-level defs and assignments, or methods of `classname`) of a wheel file, compiled unchanged
    path = site + "/sglang/srt/" + relative
    body = ast.parse(open(path).read()).body
    if classname:
        [cls] = [n for n in body if isinstance(n, ast.ClassDef) and n.name == classname]
        body = cls.body
    nodes = [n for n in body if getattr(n, "name", None) in names
             or isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) in names]
    assert len(nodes) == len(names), (relative, names)
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec", flags), module.__dict__)
    return {name: module.__dict__[name] for name in names}


io = types.ModuleType("sglang_io_struct")  # pydantic resolves the class's annotations in its module
sys.modules[io.__name__] = io
typing_names = ("Annotated", "Any", "Dict", "List", "Literal", "Optional", "Union")
io.__dict__.update({name: getattr(typing, name) for name in typing_names})
io.__dict__.update(dataclass=dataclasses.dataclass, field=dataclasses.field, Counter=collections.Counter, uuid=uuid,
                   copy=copy, warnings=warnings, PlainValidator=pydantic.PlainValidator,
                   validate_optional_list_i64_1d_2d=validate_optional_list_i64_1d_2d, KvHintsEnvelope=KvHintsEnvelope,
                   decode_kv_hints_envelope=decode_kv_hints_envelope, Modality=typing.Any, PositionalEmbeds=typing.Any,
                   MultimodalDataInputFormat=typing.Any, has_valid_data=None,  # multimodal only
                   CaptureHiddenMode=types.SimpleNamespace(FULL="full", LAST="last", NULL="null"))
compiled("managers/schedule_batch.py", ["ReturnHiddenStatesMode", "SamplingLogprobsMode",
                                        "get_return_hidden_states_mode"], io)
[GenerateReqInput] = compiled("managers/io_struct.py", ["GenerateReqInput"], io).values()
request = json.load(sys.stdin)
bodies = []
for body in request["bodies"]:
    obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
    obj.normalize_batch_and_arguments()
    params = SamplingParams(**obj.sampling_params)  # tokenizer_manager.py::_create_tokenized_object
    params.normalize(None)
    params.verify(request["vocab_size"])
    fields = ("is_single", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num")
    bodies.append({name: getattr(obj, name) for name in fields} | {"max_new_tokens": params.max_new_tokens})

scheduler = types.ModuleType("logprob_result_processor")
scheduler.get_exec = lambda: types.SimpleNamespace(features=types.SimpleNamespace(enable_mis=False))  # the default
processor = type("Processor", (), compiled(
    "managers/scheduler_components/logprob_result_processor.py",
    ["_process_input_token_logprobs", "_process_input_top_logprobs", "_scoring_positions", "_uses_scoring_positions"],
    scheduler, "SchedulerLogprobResultProcessor"))()
processor.model_config = types.SimpleNamespace(vocab_size=request["vocab_size"])
manager = type("TokenizerManager", (), compiled(
    "managers/tokenizer_manager.py", ["detokenize_logprob_tokens", "detokenize_top_logprobs_tokens"],
    types.ModuleType("tokenizer_manager"), "TokenizerManager"))()
metas = []
for case in request["cases"]:  # a prefill-only request's last prefill chunk
    logprob = types.SimpleNamespace(top_logprobs_num=case["top_k"])
    req = types.SimpleNamespace(is_prefill_only=True, token_indices_to_pool=None, logprob=logprob,
                                origin_input_ids=case["input_ids"], logprob_start_len=case["start"],
                                temp_input_top_logprobs_val=[case["top_values"]],
                                temp_input_top_logprobs_idx=[case["top_ids"]])
    processor._process_input_token_logprobs(req, case["values"])
    processor._process_input_top_logprobs(req)
    metas.append({
        "input_token_logprobs": manager.detokenize_logprob_tokens(
            logprob.input_token_logprobs_val, logprob.input_token_logprobs_idx, False),
        "input_top_logprobs": manager.detokenize_top_logprobs_tokens(
            logprob.input_top_logprobs_val, logprob.input_top_logprobs_idx, False),
    })
print(json.dumps({"bodies": bodies, "metas": metas}))
"""
PINNED = {  # what the embedded engine copies and the client relies on, checked to be in the wheel's text
    "srt/managers/scheduler.py": "is higher than the number of input tokens {len(req.origin_input_ids)=}. Please use "
    "a smaller logprob_start_len.",
    "srt/managers/schedule_batch.py": "return self.sampling_params.max_new_tokens == 0 and spec_alg is None",
    "srt/managers/scheduler_components/output_streamer.py": "len(output_ids_) if req.is_retracted else "
    "max(len(output_ids_), 1)",
}


def _case(input_ids: list[int], start: int, top_k: int, seed: int) -> dict[str, Any]:
    """Per-position numbers as SGLang's forward hands them over for prompt positions start-1..P-1 (a request
    from `prefill_body(input_ids, start, top_k)`): a log-prob each (the last one's, for the token after the
    prompt, is SGLang's padding) and the top-k at each."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.log_softmax(torch.randn(len(input_ids) - start + 1, VOCAB, generator=g), dim=-1)
    targets = torch.tensor([*input_ids[start:], 0])
    values, ids = rows.topk(top_k, dim=-1)
    return {
        "input_ids": input_ids,
        "start": start - 1,
        "top_k": top_k,
        "values": rows.gather(-1, targets[:, None])[:, 0].tolist(),
        "top_values": values.tolist(),
        "top_ids": ids.tolist(),
    }


def _embedded_meta(case: dict[str, Any]) -> dict[str, Any]:
    """The embedded engine's prefill-only reply built from the same numbers (prefill.py keeps positions
    start-1..P-2, the last one's belongs to output_top_logprobs)."""
    sampling = RowSampling(temperature=1.0, top_p=1.0, top_k=-1, generator=None)
    top = [list(zip(v, i, strict=True)) for v, i in zip(case["top_values"], case["top_ids"], strict=True)]
    seq = Sequence(rid="r", prompt=case["input_ids"], sampling=sampling, max_new_tokens=0, stop_ids=frozenset(),
                   top_logprobs_num=case["top_k"], logprob_start_len=case["start"],
                   input_logprobs=case["values"][:-1], input_top_logprobs=top[:-1], top_logprobs=top[-1:],
                   finish=FinishReason(type="length", length=0),
                   version_spans=[WeightVersionSpan(version="default", start=0, end=0)])  # fmt: skip
    return json.loads(json.dumps(response(seq, return_logprob=True, started=0.0)["meta_info"]))


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


def test_prefill_requests_parse_and_align_as_sglangs_code_says(site: Path) -> None:
    for file, text in PINNED.items():
        assert text in sglang_file(site, file).read_text(), file
    bodies = [prefill_body([5, 6, 7, 8, 9], 3, top_k=4), prefill_body([5, 6, 7], 1), prefill_body([1, 2], 2, 2)]
    cases = [_case([5, 6, 7, 8, 9], 3, 4, seed=0), _case([5, 6, 7], 1, 3, seed=1), _case([1, 2], 2, 2, seed=2)]
    command = [sys.executable, "-c", SIDE, str(site)]
    request = json.dumps({"bodies": bodies, "cases": cases, "vocab_size": VOCAB})
    done = subprocess.run(command, input=request, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for body, parsed in zip(bodies, theirs["bodies"], strict=True):
        assert parsed["is_single"] and parsed["input_ids"] == body["input_ids"] and parsed["return_logprob"]
        assert parsed["logprob_start_len"] == body["logprob_start_len"] and parsed["max_new_tokens"] == 0
        assert parsed["top_logprobs_num"] == body.get("top_logprobs_num", 0)
    for case, meta in zip(cases, theirs["metas"], strict=True):
        ours = _embedded_meta(case)
        assert ours["input_token_logprobs"] == meta["input_token_logprobs"]
        assert ours["input_top_logprobs"] == meta["input_top_logprobs"]
        start, ids = case["start"] + 1, case["input_ids"]
        aligned = scored_log_probs(meta, len(ids), start)
        assert aligned.token_ids == ids[start:] and aligned.logprobs == case["values"][:-1]
        assert aligned.top_ids == case["top_ids"][:-1] and aligned.top_logprobs == case["top_values"][:-1]
