"""megarl's LoRA serving checked against SGLang 0.5.23's own code, on CPU (the rest of the engine boundary:
test_sglang_contract.py, whose request-struct check covers the two LoRA endpoints and `lora_path`).

A `/load_lora_adapter_from_tensors` body as megarl builds it loads through SGLang's TP-worker code and config parser
(tests/cases/sglang_side.py `lora`); the target names megarl lets through are SGLang's; the embedded engine's replies
and refusals are SGLang's words and fields.
"""

import ast
from pathlib import Path

import pytest
import torch
from cases.sglang_env import run_side, sglang_file, sglang_site

from megarl.engines.client import sglang_api
from megarl.engines.embedded.lora_server import NOT_ENABLED, TENSOR_PATH
from megarl.engines.replicas.sglang_command import SGLANG_LORA_TARGETS
from megarl.engines.weights.adapters import adapter_entries

pytestmark = pytest.mark.slow
IO = "srt/managers/io_struct.py"
LORA_REPLIES = {
    # what the embedded engine answers (megarl/engines/embedded/lora_server.py), where SGLang says it
    "srt/managers/tokenizer_control_mixin.py": NOT_ENABLED,
    IO: f'lora_path="{TENSOR_PATH}"',  # LoadLoRAAdapterFromTensorsReqInput.to_ref
    "srt/lora/lora_registry.py": "does not exist. Loaded LoRAs:",
    "srt/lora/lora_manager.py": "because it is already loaded",
    "srt/managers/tokenizer_manager.py": "was requested, but LoRA is not enabled. ",
    "srt/arg_groups/fields/lora.py": "choices=SUPPORTED_LORA_TARGET_MODULES + [LORA_TARGET_ALL_MODULES]",
}


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


def _constants(source: str) -> dict[str, object]:
    """The module-level constants of `source` that are literals."""
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def test_lora_replies_and_targets_are_sglangs(site: Path) -> None:
    """The messages and LoRAUpdateOutput fields the embedded engine answers with, and `--lora-target-modules`'
    choices (SGLANG_LORA_TARGETS), read from SGLang's sources."""
    for file, line in LORA_REPLIES.items():
        assert line in sglang_file(site, file).read_text(), (file, line)
    io = ast.parse(sglang_file(site, IO).read_text())
    (output,) = [n for n in ast.walk(io) if isinstance(n, ast.ClassDef) and n.name == "LoRAUpdateOutput"]
    fields = [n.target.id for n in output.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert fields == ["success", "error_message", "loaded_adapters"]
    common = _constants(sglang_file(site, "srt/utils/common.py").read_text())
    assert [*common["SUPPORTED_LORA_TARGET_MODULES"], common["LORA_TARGET_ALL_MODULES"]] == list(SGLANG_LORA_TARGETS)


def test_lora_adapter_payloads_load_in_sglang(site: Path, tmp_path: Path) -> None:
    """A body with an entry per TP rank (two) goes through SGLang's HTTP decoding, its payload normalization and
    tp_worker.py::BaseTpWorker.load_lora_adapter_from_tensors as rank 1, whose config parse (lora_config.py::
    LoRAConfig.from_dict) reads the PEFT dict: the tensors arrive as sent."""
    tensors = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{f}.weight": torch.randn(4, 4) for f in "AB"}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"], "lora_dropout": 0.0}
    entries = adapter_entries([*tensors.items()], 2)
    body = {"lora_name": "v1", "config_dict": config, "serialized_named_tensors": entries}
    sglang_api.check_payload("/load_lora_adapter_from_tensors", body)
    answer = run_side(site, "lora", {"body": body, "tp_rank": 1, "out": str(tmp_path / "lora.pt")})
    assert answer == {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}
    loaded = torch.load(tmp_path / "lora.pt")
    assert list(loaded) == list(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())
