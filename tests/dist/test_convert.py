"""HF ⇄ megatron checkpoint conversion: bit-exact round trips through real megatron layouts, clear errors.

One 4-process gloo world for every model (one spawn's start-up, the models in turn): load each converted
checkpoint at TP2×PP2 (dense) or TP2×EP2 (MoE), compare the weights and log-probs with HF, save it from there with
megatron, reload that at TP1 and compare log-probs again; then convert the megatron-written checkpoint back to HF and
compare every tensor bit for bit.
"""

import json
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases.megatron_cases import (
    ASSET_MODELS,
    hf_log_probs,
    layout,
    rank_calls,
    sample_batch,
    save_asset_model,
    save_random_model,
)
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.cli.convert import main as convert_main
from megarl.convert.dist_layout import dist_slot
from megarl.convert.hf_io import COPIED_FILES, INDEX_FILE, SafetensorsShardWriter, TensorEntry
from megarl.convert.stream import (
    ConversionError,
    ConversionStats,
    Stages,
    check_layout,
    hf_to_mcore,
    mcore_to_hf,
    spec_of,
)
from megarl.megatron.dcp_io import Chunk, DcpReader, Slice, write_chunks
from megarl.megatron.launch import spawn
from megarl.megatron.parallel import ParallelLayout
from megarl.megatron.weights import SafetensorsReader
from megarl.models.spec import load_hf_config, model_spec
from megarl.models.weight_map import padded_vocab_size, weight_plan

WORLD = 4
REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "megarl" / "assets" / "tokenizer"


def rank_round_trip(
    hf_dir: Path, mcore_dir: Path, saved_dir: Path, role_layout: ParallelLayout, batch: dict[str, torch.Tensor]
) -> dict[str, object]:
    """Load the converted checkpoint at `role_layout`, save it with megatron, reload that at TP1."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megarl.megatron.dist_ckpt import load_model, model_sharded_state_dict, save_model
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.weights import gather_hf_weights, local_mapping
    from megarl.models.spec import load_hf_config, model_spec
    from megarl.models.weight_map import padded_vocab_size, weight_plan

    spec = model_spec(load_hf_config(hf_dir))
    groups = build_role_groups(role_layout)
    model = build_model(spec, groups, seed=99)
    load_model(model.chunks, groups, mcore_dir)
    reader = SafetensorsReader(hf_dir)
    gathered = gather_hf_weights(model, groups)
    differing = [name for name, tensor in gathered.items() if not torch.equal(tensor, reader.get(name))]
    slot_errors = []
    (chunk,) = model.chunks
    plan = weight_plan(spec, padded_vocab_size(spec.vocab_size, role_layout.tp))
    for name, sharded in model_sharded_state_dict(model.chunks, groups).items():
        if not isinstance(sharded, ShardedTensor | ShardedTensorFactory):
            continue
        mapping, _, _ = local_mapping(name, chunk, groups, plan, spec)  # a tied output layer → the embedding
        slot = dist_slot(mapping.mcore_name, spec)
        if slot.key != sharded.key:
            slot_errors.append(f"{name}: {slot.key} vs {sharded.key}")
        elif isinstance(sharded, ShardedTensor):
            axes = sharded.prepend_axis_num
            if (slot.prefix, slot.prefix_sizes) != (sharded.global_offset[:axes], sharded.global_shape[:axes]):
                slot_errors.append(f"{name}: {slot} vs {sharded.global_offset} {sharded.global_shape}")
    batching = MicroBatching(micro_batch_size=3)
    log_probs = MegatronEngine(model, groups).forward(batch, batching)["log_probs"]
    save_model(model.chunks, groups, saved_dir)
    children = [child.name for child in multiprocessing.active_children()]  # megatron's writers joined, no Manager
    torch.distributed.barrier()
    tp1 = build_role_groups(ParallelLayout(world_size=WORLD))
    model1 = build_model(spec, tp1, seed=7)
    load_model(model1.chunks, tp1, saved_dir)
    log_probs_tp1 = MegatronEngine(model1, tp1).forward(batch, batching)["log_probs"]
    return {
        "num_gathered": len(gathered),
        "children": children,
        "differing": differing,
        "slot_errors": slot_errors,
        "log_probs": log_probs,
        "log_probs_tp1": log_probs_tp1,
    }


CASES = {
    "tiny_dense": ({"tp": 2, "stages": Stages(2)}, layout(WORLD, tp=2, pp=2)),
    "tiny_moe": ({"tp": 2, "ep": 2}, layout(WORLD, tp=2, ep=2)),
    "tiny_qwen2_moe": ({"tp": 2, "ep": 2}, layout(WORLD, tp=2, ep=2)),  # a gated shared expert
    "tiny_glm4_moe": ({"tp": 2, "ep": 2}, layout(WORLD, tp=2, ep=2)),  # dense layer 0: a key per layer; expert bias
    "qwen2_tied": ({"tp": 2, "stages": Stages(2)}, layout(WORLD, tp=2, pp=2)),  # the last stage holds a tied copy
    "tiny_deepseek_v3": (
        {"tp": 2, "stages": Stages(2)},
        layout(WORLD, tp=2, pp=2),
    ),  # MLA; dense and MoE stages
    "tiny_qwen2_5_vl": ({"tp": 2, "stages": Stages(2)}, layout(WORLD, tp=2, pp=2)),  # the vision tower on stage 0
    "tiny_qwen3_vl": ({"tp": 2, "stages": Stages(2)}, layout(WORLD, tp=2, pp=2)),  # nested HF names, deepstack
}


@pytest.fixture(scope="module")
def round_trips(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, ConversionStats, list[dict[str, object]]]]:
    """name → (its directory, hf_to_mcore's stats, every rank's `rank_round_trip`): all of `CASES` in one spawn."""
    dirs, stats, calls = {}, {}, []
    batch = sample_batch(4096)
    for name, (sizes, role_layout) in sorted(CASES.items()):
        root = dirs[name] = tmp_path_factory.mktemp(name)
        if name == "qwen2_tied":
            hf_dir = save_random_model("qwen2", root / "hf", vocab_size=4096, tie=True)
        else:
            hf_dir = save_asset_model(name, root / "hf")
        stats[name] = hf_to_mcore(hf_dir, root / "mcore", **sizes)
        calls.append((rank_round_trip, (hf_dir, root / "mcore", root / "saved", role_layout, batch)))
    per_rank = spawn(rank_calls, WORLD, calls)
    return {name: (dirs[name], stats[name], [rank[i] for rank in per_rank]) for i, name in enumerate(sorted(CASES))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_is_bit_exact_and_loads_at_other_layouts(
    round_trips: dict[str, tuple[Path, ConversionStats, list[dict[str, object]]]], name: str
) -> None:
    tmp_path, stats, results = round_trips[name]
    hf_dir = tmp_path / "hf"
    assert stats.num_bytes > 0 and stats.peak_rss_bytes >= 0
    assert not list(tmp_path.glob(".*.partial"))
    batch = sample_batch(4096)

    reader = SafetensorsReader(hf_dir)
    for result in results:
        assert result["differing"] == [] and result["slot_errors"] == []
        assert result["children"] == []  # megarl.megatron.dist_ckpt._results_in_process: no process left running
    assert sum(r["num_gathered"] for r in results) >= len(reader.names())
    expected = hf_log_probs(hf_dir, batch)
    for result in results:
        assert (result["log_probs"] - expected).abs().max() <= 1e-4
        assert (result["log_probs_tp1"] - result["log_probs"]).abs().max() <= 1e-5

    back = tmp_path / "back"
    mcore_to_hf(tmp_path / "saved", hf_dir, back, max_shard_bytes=200_000)
    returned = SafetensorsReader(back)
    assert sorted(returned.names()) == sorted(reader.names())
    for tensor_name in reader.names():
        assert torch.equal(returned.get(tensor_name), reader.get(tensor_name)), tensor_name
    index = json.loads((back / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (back / "config.json").read_text() == (hf_dir / "config.json").read_text()


def test_norms_sit_under_the_keys_transformer_engine_layers_load() -> None:
    # megatron's TE layer fuses the norms into linear_qkv and (dense) linear_fc1 as `layer_norm_weight`; a MoE
    # layer's pre-MLP norm is a TENorm of its own (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec).
    # The round trip checks the local spec's sharded_state_dict against `dist_slot`; tests/gpu loads with TE.
    dense, moe = (model_spec(load_hf_config(ASSET_MODELS / name)) for name in ("tiny_dense", "tiny_moe"))
    for spec in (dense, moe):
        key = dist_slot("decoder.layers.1.input_layernorm.weight", spec).key
        assert key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    pre_mlp = "decoder.layers.1.pre_mlp_layernorm.weight"
    assert dist_slot(pre_mlp, dense).key == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert dist_slot(pre_mlp, moe).key == "decoder.layers.pre_mlp_layernorm.weight"


def test_mla_norms_sit_under_the_keys_transformer_engine_layers_load() -> None:
    # TE's MLA layer keeps the input norm a TENorm and fuses the latent norms into the up projections.
    spec = model_spec(load_hf_config(ASSET_MODELS / "tiny_deepseek_v3"))
    keys = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
        "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    }
    for local, te in keys.items():
        assert dist_slot(f"decoder.layers.1.{local}", spec).key == f"decoder.layers.1.{te}"
    assert dist_slot("decoder.layers.0.pre_mlp_layernorm.weight", spec).key.endswith("mlp.linear_fc1.layer_norm_weight")
    assert dist_slot("decoder.layers.1.pre_mlp_layernorm.weight", spec).key.endswith("pre_mlp_layernorm.weight")


def rank_load_error(hf_dir: Path, mcore_dir: Path) -> str:
    from megarl.megatron.dist_ckpt import load_model
    from megarl.megatron.model import build_model
    from megarl.megatron.parallel import build_role_groups
    from megarl.models.spec import load_hf_config, model_spec

    groups = build_role_groups(layout(2, tp=2))
    model = build_model(model_spec(load_hf_config(hf_dir)), groups)
    try:
        load_model(model.chunks, groups, mcore_dir)
    except ValueError as err:
        return str(err)
    return "loaded"


def test_loading_at_a_tp_that_pads_the_vocabulary_differently_names_the_fix(tmp_path: Path) -> None:
    hf_dir = save_random_model("qwen2", tmp_path / "hf", vocab_size=100)
    hf_to_mcore(hf_dir, tmp_path / "mcore", tp=1)  # pads 100 to 128; TP=2 pads to 256
    for message in spawn(rank_load_error, 2, hf_dir, tmp_path / "mcore"):
        assert "pads the vocabulary to 128 rows but tensor-parallel size 2 pads it to 256" in message
        assert "convert again with --tp 2" in message


def _rewrite(hf_dir: Path, change: dict[str, torch.Tensor | None]) -> None:
    reader = SafetensorsReader(hf_dir)
    tensors = {name: reader.get(name) for name in reader.names()}
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, str(hf_dir / "model.safetensors"))


def test_errors_name_the_problem(tmp_path: Path) -> None:
    hf_dir = save_random_model("qwen2", tmp_path / "hf")
    with pytest.raises(ConversionError, match="--tp 3 must divide the 4 attention heads"):
        hf_to_mcore(hf_dir, tmp_path / "out", tp=3)
    with pytest.raises(ConversionError, match="--ep 2 needs a mixture-of-experts model"):
        hf_to_mcore(hf_dir, tmp_path / "out", ep=2)
    with pytest.raises(ConversionError, match="--pp 3 must divide the 2 layers; or set --first-stage-layers"):
        hf_to_mcore(hf_dir, tmp_path / "out", stages=Stages(3))
    with pytest.raises(ConversionError, match=r"split the 2 layers as \[2, 0\]: every stage needs a layer"):
        hf_to_mcore(hf_dir, tmp_path / "out", stages=Stages(2, first=2))
    check_layout(spec_of(hf_dir), 1, Stages(2, last=1), 1)  # uneven splits pass (DeepSeek-V3's 61 as 20/21/20)
    assert Stages(3, first=20, last=20).problem(61) is None

    _rewrite(
        hf_dir,
        {
            "model.layers.1.mlp.up_proj.weight": None,
            "model.layers.0.mlp.extra.weight": torch.zeros(2),
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64),
        },
    )
    with pytest.raises(ConversionError) as err:
        hf_to_mcore(hf_dir, tmp_path / "out")
    message = str(err.value)
    assert "missing 1 tensors the config implies: model.layers.1.mlp.up_proj.weight" in message
    assert "1 tensors the qwen2 mapping does not know: model.layers.0.mlp.extra.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight (32, 64) (config implies (64, 64))" in message
    assert not (tmp_path / "out").exists()

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConversionError, match="gpt2"):
        hf_to_mcore(hf_dir, tmp_path / "out")


def test_mcore_to_hf_checks_the_config_against_the_checkpoint(tmp_path: Path) -> None:
    two_layers = save_random_model("qwen3", tmp_path / "two")
    three_layers = save_random_model("qwen3", tmp_path / "three", num_layers=3)
    hf_to_mcore(two_layers, tmp_path / "mcore")
    with pytest.raises(ConversionError, match=r"shape mismatches: decoder\.layers\..* \(2, .*\(config implies \(3, "):
        mcore_to_hf(tmp_path / "mcore", three_layers, tmp_path / "out")
    with pytest.raises(ConversionError, match="no metadata.json"):
        mcore_to_hf(tmp_path, two_layers, tmp_path / "out")


def _cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.convert_ckpt", *map(str, args)], cwd=REPO, capture_output=True, text=True
    )


def _in_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str | Path
) -> subprocess.CompletedProcess:
    """`megarl-convert`'s `main` (what `python -m tools.convert_ckpt` runs) in this process: its exit status and
    output without another interpreter's imports (the subprocess runs above cover the module entry)."""
    monkeypatch.setattr(sys, "argv", ["megarl-convert", *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        convert_main()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, exit_.value.code, out.out, out.err)


def test_cli_converts_verifies_and_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = save_random_model("mixtral", tmp_path / "hf")
    tokenizer_files = sorted(p.name for p in TOKENIZER_DIR.iterdir() if p.is_file() and p.name in COPIED_FILES)
    assert tokenizer_files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in tokenizer_files:
        shutil.copyfile(TOKENIZER_DIR / name, hf_dir / name)
    other = save_random_model("mixtral", tmp_path / "other", seed=1)
    to_mcore = _cli("hf-to-mcore", "--hf", hf_dir, "--out", tmp_path / "mcore", "--ep", "2")
    assert to_mcore.returncode == 0, to_mcore.stderr
    assert "GB/s" in to_mcore.stdout and "peak RSS growth" in to_mcore.stdout
    to_hf = _in_process(
        capsys,
        monkeypatch,
        "mcore-to-hf",
        "--mcore",
        tmp_path / "mcore",
        "--hf-config",
        hf_dir,
        "--out",
        tmp_path / "back",
    )
    assert to_hf.returncode == 0, to_hf.stderr
    assert (tmp_path / "back" / INDEX_FILE).is_file()
    for name in ["config.json", "generation_config.json", *tokenizer_files]:
        assert (tmp_path / "back" / name).read_bytes() == (hf_dir / name).read_bytes(), name

    good = _cli("verify", "--hf", tmp_path / "back", "--mcore", tmp_path / "mcore")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "tensors: 41 compared, 0 differ" in good.stdout and good.stdout.strip().endswith("OK")
    bad = _in_process(capsys, monkeypatch, "verify", "--hf", other, "--mcore", tmp_path / "mcore")
    assert bad.returncode == 1
    assert "tensors: 41 compared, 41 differ" in bad.stdout and "MISMATCH" in bad.stdout

    missing = _in_process(capsys, monkeypatch, "hf-to-mcore", "--hf", tmp_path / "nowhere", "--out", tmp_path / "x")
    assert missing.returncode == 2
    assert "nowhere/config.json does not exist" in missing.stderr


def test_shard_writer_puts_each_shard_on_disk_as_soon_as_it_is_complete(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: what follows must still be aligned
        "b": torch.randn(4, 4, generator=g).t(),  # not contiguous
        "c": torch.randn(7, generator=g).to(torch.bfloat16),
        "d": torch.randn(2, 3, generator=g).double(),
        "e": torch.randn(10, generator=g),
    }
    entries = [TensorEntry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    writer = SafetensorsShardWriter(tmp_path, entries, max_shard_bytes=100)  # [a, b] [c, d] [e]
    with pytest.raises(ValueError, match=r"b: got \(16,\) torch.float32, declared \(4, 4\)"):
        writer.write("b", tensors["b"].reshape(16))
    on_disk = []
    for name, tensor in tensors.items():
        writer.write(name, tensor)
        on_disk.append(len(list(tmp_path.glob("model-*.safetensors"))))
    writer.close()
    assert on_disk == [0, 1, 1, 2, 3] and writer.num_finished == 3
    assert not list(tmp_path.glob(".*"))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"]["d"] == "model-00002-of-00003.safetensors"
    reader = SafetensorsReader(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(reader.get(name), tensor), name
    with safe_open(str(tmp_path / "model-00001-of-00003.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def _save_deep_llama(path: Path, num_layers: int) -> Path:
    """Random HF weights of a narrow llama with many layers, straight from the weight plan (no transformers model)."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 4096,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    spec = model_spec(load_hf_config(path))
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=g)
        for mapping in weight_plan(spec, padded_vocab_size(spec.vocab_size, 1)).values()
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes, strict=True)
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def rank_mcore_to_hf(mcore_dir: Path, hf_dir: Path, out_dir: Path, read_batch_bytes: int) -> tuple[int, int, int]:
    """In a fresh process (no freed heap from earlier tests to hide allocations): (bytes, peak RSS growth, largest)."""
    from megarl.convert import stream

    stream.READ_BATCH_BYTES = read_batch_bytes
    stats = stream.mcore_to_hf(mcore_dir, hf_dir, out_dir, max_shard_bytes=2**30)  # one shard: the whole model
    reader = SafetensorsReader(hf_dir)
    largest = max(reader.get(name).nbytes for name in reader.names())
    return stats.num_bytes, stats.peak_rss_bytes, largest


def test_mcore_to_hf_memory_is_one_read_batch_whatever_the_depth_and_shard_size(tmp_path: Path) -> None:
    hf_dir = _save_deep_llama(tmp_path / "hf", num_layers=48)
    hf_to_mcore(hf_dir, tmp_path / "mcore")
    batch = 4 * 2**20
    ((num_bytes, growth, largest),) = spawn(rank_mcore_to_hf, 1, tmp_path / "mcore", hf_dir, tmp_path / "back", batch)
    assert num_bytes > 45e6 and largest <= 2 * 2**20
    # Holding the output shard until it is full held the whole model here (1.1× the weights on a 30-layer llama).
    assert growth < 3 * (batch + largest), f"peak RSS growth {growth / 1e6:.1f} MB of {num_bytes / 1e6:.1f} MB"
    returned, reader = SafetensorsReader(tmp_path / "back"), SafetensorsReader(hf_dir)
    assert sorted(returned.names()) == sorted(reader.names())
    assert all(torch.equal(returned.get(name), reader.get(name)) for name in reader.names())


def test_dcp_reader_reads_slices_across_stored_chunks(tmp_path: Path) -> None:
    full = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)  # [layers, rows, cols]
    rows = [Chunk("w", (0, row, 0), (1, 2, 6), (2, 4, 6), torch.float32) for row in (0, 2)]  # layer 0: by rows
    cols = [Chunk("w", (1, 0, col), (1, 4, 3), (2, 4, 6), torch.float32) for col in (0, 3)]  # layer 1: by columns
    write_chunks(tmp_path, rows + cols, lambda c: full[_box(c.offsets, c.sizes)])
    reader = DcpReader(tmp_path, reuse_buffer=True)
    wanted = [((0, 0, 0), (1, 4, 6)), ((1, 0, 0), (1, 4, 6)), ((0, 1, 0), (1, 2, 6)), ((1, 1, 2), (1, 2, 3))]
    for _ in range(2):  # the second call reuses the buffer
        tensors = reader.read([Slice("w", offsets, sizes) for offsets, sizes in wanted])
        for (offsets, sizes), tensor in zip(wanted, tensors, strict=True):
            assert torch.equal(tensor, full[_box(offsets, sizes)]), (offsets, sizes)


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes, strict=True))
