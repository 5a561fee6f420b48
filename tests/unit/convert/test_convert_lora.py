"""megarl-convert's LoRA commands against peft and transformers, in one process.

A PEFT adapter with random A and B on a tiny model is the reference; its tensors, written as a LoRA actor's trainer
checkpoint (torch_dist, single process, in a run directory with megarl-train's config.yaml), go through
`lora-to-peft` and `lora-merge`, and the results are loaded by peft and transformers.
"""

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from cases.lora_cases import TARGETS, save_random_adapter
from cases.megatron_cases import save_random_model
from conftest import compose_config

from megarl.cli.convert import main, run
from megarl.convert.hf_io import INDEX_FILE
from megarl.lora.peft_io import read_peft
from megarl.megatron.dcp_io import Chunk, write_chunks
from megarl.megatron.weights import SafetensorsReader
from megarl.trainer.prepare import write_resolved_config

RANK = 4
ALPHA = 2.0 * RANK  # save_random_adapter's lora_alpha
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT = "model.layers.1.mlp.experts.3.gate_proj"


def write_trainer_checkpoint(tensors: dict[str, torch.Tensor], run_dir: Path, with_config: bool) -> Path:
    """`tensors` as a LoRA actor's trainer checkpoint; `with_config`: the run's config.yaml, as megarl-train
    writes it, holds actor.lora's rank and alpha."""
    ckpt = run_dir / "checkpoints" / "global_step_1" / "actor" / "model"
    chunks = [Chunk(name, (0,) * t.dim(), tuple(t.shape), tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_chunks(ckpt, chunks, lambda chunk: tensors[chunk.key])
    if with_config:
        write_resolved_config(compose_config(f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}"), run_dir)
    return ckpt


def load(model_dir: Path, adapter_dir: Path | None = None) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float()
    return model if adapter_dir is None else peft.PeftModel.from_pretrained(model, adapter_dir)


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(1, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids).logits  # [b, s, v]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen2 with an adapter on every projection, and that adapter as a trainer checkpoint in a run directory."""
    root = tmp_path_factory.mktemp("dense")
    base = save_random_model("qwen2", root / "base")
    adapter = save_random_adapter(base, root / "adapter", RANK, TARGETS)
    ckpt = write_trainer_checkpoint(read_peft(adapter)[1], root / "run", with_config=True)
    return {"base": base, "adapter": adapter, "ckpt": ckpt, "root": root}


def expert_factors() -> tuple[torch.Tensor, torch.Tensor]:
    """A `[r, hidden]` and B `[moe ffn, r]` for `EXPERT`, B·A of the order of its weight."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(RANK, 64, generator=g) / 8, torch.randn(32, RANK, generator=g) / 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen3_moe with a peft adapter on the attention, and a trainer checkpoint (no config.yaml) holding it plus
    random factors for one expert's gate_proj, which peft cannot target on transformers 5's fused experts."""
    root = tmp_path_factory.mktemp("moe")
    base = save_random_model("qwen3_moe", root / "base")
    adapter = save_random_adapter(base, root / "adapter", RANK, ATTENTION)
    a, b = expert_factors()
    expert = {f"base_model.model.{EXPERT}.lora_A.weight": a, f"base_model.model.{EXPERT}.lora_B.weight": b}
    ckpt = write_trainer_checkpoint({**read_peft(adapter)[1], **expert}, root / "run", with_config=False)
    return {"base": base, "adapter": adapter, "ckpt": ckpt, "root": root}


def test_lora_to_peft_loads_in_peft_as_the_original_adapter(dense: dict[str, Path]) -> None:
    out = dense["root"] / "exported"
    assert run(["lora-to-peft", "--ckpt", str(dense["ckpt"]), "--out", str(out), "--base", str(dense["base"])]) == 0
    config, tensors = read_peft(out)
    _, original = read_peft(dense["adapter"])
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (RANK, ALPHA, sorted(TARGETS))
    assert tensors.keys() == original.keys()
    assert all(torch.equal(tensors[name], original[name]) for name in original)  # what actor.lora.path reads
    expected = logits(load(dense["base"], dense["adapter"]))
    assert (logits(load(dense["base"], out)) - expected).abs().max() <= 1e-6


def test_lora_merge_of_a_trainer_checkpoint_equals_peft(dense: dict[str, Path]) -> None:
    out = dense["root"] / "merged"
    assert run(["lora-merge", "--ckpt", str(dense["ckpt"]), "--base", str(dense["base"]), "--out", str(out)]) == 0
    assert (out / INDEX_FILE).is_file()
    assert json.loads((out / "config.json").read_text()) == json.loads((dense["base"] / "config.json").read_text())
    expected = logits(load(dense["base"], dense["adapter"]))
    assert (logits(load(out)) - expected).abs().max() <= 1e-4
    base, merged = SafetensorsReader(dense["base"]), SafetensorsReader(out)
    untouched = [name for name in base.names() if not name.endswith("_proj.weight")]
    assert untouched and all(torch.equal(merged.get(name), base.get(name)) for name in untouched)


def test_lora_merge_on_moe_attention_and_one_expert(moe: dict[str, Path]) -> None:
    """The PEFT folder merged equals peft's model; the trainer checkpoint merged adds (alpha/r)·B·A to the
    expert's safetensors weight and writes every other tensor as the PEFT folder's merge does."""
    from_peft, from_ckpt = moe["root"] / "from_peft", moe["root"] / "from_ckpt"
    assert run(["lora-merge", "--ckpt", str(moe["adapter"]), "--base", str(moe["base"]), "--out", str(from_peft)]) == 0
    assert (logits(load(from_peft)) - logits(load(moe["base"], moe["adapter"]))).abs().max() <= 1e-4
    argv = ["lora-merge", "--ckpt", str(moe["ckpt"]), "--base", str(moe["base"]), "--out", str(from_ckpt)]
    assert run([*argv, "--alpha", str(ALPHA)]) == 0
    peft_merged, ckpt_merged = SafetensorsReader(from_peft), SafetensorsReader(from_ckpt)
    weight = f"{EXPERT}.weight"
    a, b = expert_factors()
    expected = SafetensorsReader(moe["base"]).get(weight) + ALPHA / RANK * b @ a
    assert torch.allclose(ckpt_merged.get(weight), expected, atol=1e-6)
    others = [name for name in peft_merged.names() if name != weight]
    assert all(torch.equal(ckpt_merged.get(name), peft_merged.get(name)) for name in others)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("full-weight checkpoint", "holds no LoRA adapters"),
        ("no alpha", "pass --alpha"),
        ("MoE adapter on a dense base", f"does not have 1 of the weights the adapter adapts ({EXPERT}.weight)"),
    ],
)
def test_cli_refuses_with_a_clear_error(
    case: str,
    message: str,
    dense: dict[str, Path],
    moe: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = str(tmp_path / "out")
    if case == "full-weight checkpoint":
        ckpt = write_trainer_checkpoint({"embedding.word_embeddings.weight": torch.ones(8, 4)}, tmp_path, False)
        argv = ["lora-to-peft", "--ckpt", str(ckpt), "--out", out]
    elif case == "no alpha":
        argv = ["lora-to-peft", "--ckpt", str(moe["ckpt"]), "--out", out]
    else:
        argv = ["lora-merge", "--ckpt", str(moe["ckpt"]), "--base", str(dense["base"]), "--out", out, "--alpha", "8"]
    monkeypatch.setattr("sys.argv", ["megarl-convert", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not Path(out).exists()
