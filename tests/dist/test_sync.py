"""Weight sync from Megatron (4 gloo ranks) into real embedded engine processes started with dummy weights."""

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cases.engine_cases import save_engine_model, start_engine
from cases.megatron_cases import layout, save_asset_model
from cases.sync_cases import (
    Replicas,
    rank_colocated_cycles,
    rank_delta_sync,
    rank_expert_bias_sync,
    rank_peer_writes,
    rank_sync_memory,
    rank_sync_twice,
)

from megarl.engines.client.auth import EngineKeys
from megarl.engines.replicas.server_process import ServerProcess
from megarl.megatron.launch import spawn

WORLD = 4
StartEngines = Callable[..., list[str]]
"""(model directory, count, *extra flags): start `count` dummy-weight engines; returns their URLs."""
TOLERANCE = 1e-4


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[StartEngines]:
    started: list[ServerProcess] = []

    def start(model_dir: Path, count: int, *extra: str) -> list[str]:
        with ThreadPoolExecutor(count) as pool:
            results = list(
                pool.map(lambda _: start_engine(model_dir, tmp_path, "--load-format", "dummy", *extra), range(count))
            )
        started.extend(server for server, _ in results)
        return [url for _, url in results]

    yield start
    for server in started:
        server.stop()


@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("tiny_dense", {"tp": 2, "pp": 2}),
        # routed + shared experts; tiny_moe syncs in test_trainer_e2e.py (MoE run)
        ("tiny_qwen2_moe", {"ep": 2, "tp": 2}),
        ("tiny_glm4_moe", {"tp": 2, "pp": 2, "sequence_parallel": True}),  # stage 0 dense, 1 MoE; sends expert_bias
        ("tiny_deepseek_v3", {"ep": 2, "tp": 2}),  # every MLA tensor by name, through the engine's transformers
    ],
    ids=["dense-tp2pp2", "qwen2-moe-ep2tp2", "glm4-moe-tp2pp2", "deepseek-v3-ep2tp2"],
)
def test_engines_match_the_trainer_after_each_of_two_syncs(
    tmp_path: Path, engines: StartEngines, model: str, sizes: dict[str, int]
) -> None:
    model_dir = save_asset_model(model, tmp_path / model)
    # Two tensor replicas read the same kept shared-memory buckets in both rounds (round 2 once failed
    # with "unable to open shared memory object" when one handle served both), one joins by broadcast.
    *tensor_urls, broadcast_url = engines(model_dir, 3)
    replicas = Replicas(tensor=tensor_urls, broadcast=[broadcast_url])
    out = spawn(rank_sync_twice, WORLD, model_dir, layout(WORLD, **sizes), replicas, 2**20)[0]
    gaps, versions, metrics = out["gaps"], out["versions"], out["metrics"]
    for round_ in (1, 2):
        for url in [*tensor_urls, broadcast_url]:
            assert gaps[f"{round_}/{url}"] <= TOLERANCE, (round_, url, gaps)
            assert versions[f"{round_}/{url}"] == f"v{round_}"
    for url in [*tensor_urls, broadcast_url]:
        assert gaps[f"stale/{url}"] > 100 * TOLERANCE, "the training step did not change the policy"
    for kind in ("tensor", "broadcast"):
        first, second = metrics[f"1/{kind}"], metrics[f"2/{kind}"]
        assert first.bytes == second.bytes > 0 and first.bytes_skipped == 0
        assert first.buckets > 1  # the 1 MiB buckets force several per sender
        assert first.gb_per_s > 0


def test_the_fp32_expert_bias_reaches_bf16_engines_exactly(tmp_path: Path, engines: StartEngines) -> None:
    """HF and SGLang keep DeepSeek-V3's `e_score_correction_bias` in fp32 in a bf16 model (it decides the experts):
    the sync sends it in fp32 buckets of its own, so each bf16 engine's bias equals the trainer's bit for bit.
    The engines take keys, as a run's do: the sync's calls carry them."""
    model_dir = save_asset_model("tiny_deepseek_v3", tmp_path / "deepseek")
    keys = EngineKeys.generate()
    flags = ("--dtype", "bfloat16", "--api-key", keys.api, "--admin-api-key", keys.admin)
    tensor_url, broadcast_url = engines(model_dir, 2, *flags)
    replicas = Replicas(tensor=[tensor_url], broadcast=[broadcast_url])
    trainer, engine = spawn(rank_expert_bias_sync, 2, model_dir, layout(2, ep=2), replicas, keys)[0].values()
    assert len(trainer) == 3
    for name, bias in trainer.items():
        assert not torch.equal(bias.bfloat16().float(), bias)  # bf16 would change it
        for url, biases in engine.items():
            assert torch.equal(biases[name], bias), (url, name, (biases[name] - bias).abs().max().item())


def test_tp_peers_write_their_shards_into_the_owners_bucket_and_nothing_is_gathered(
    tmp_path: Path, engines: StartEngines
) -> None:
    """At TP=2 on one machine each rank copies its own shards into the owner's shared-memory bucket: the
    engine matches the trainer after each sync, and no shard crosses a point-to-point link (the gather
    sent every peer shard to the owner)."""
    model_dir = save_asset_model("tiny_dense", tmp_path / "dense")
    (url,) = engines(model_dir, 1)
    bucket = 2**19
    out = spawn(rank_peer_writes, 2, model_dir, layout(2, tp=2), url, bucket)
    total, largest = out[0]["total"], out[0]["largest"]
    assert largest > bucket  # the embedding and output layer go through one-off buffers, peers write those too
    for round_ in (0, 1):
        assert out[0]["stale"][round_] > 100 * TOLERANCE  # dummy weights, then a training step
        assert out[0]["gaps"][round_] <= TOLERANCE, out[0]["gaps"]
        moved = sum(rank["p2p"][round_] for rank in out)
        assert moved < 0.01 * total, f"sync {round_ + 1}: {moved} of {total} bytes went point to point"


def test_peak_sender_memory_stays_below_two_buckets_and_the_largest_tensor(
    tmp_path: Path, engines: StartEngines
) -> None:
    model_dir = save_engine_model(tmp_path / "wide", hidden=512, layers=4)  # 81 MB fp32, 8.4 MB largest tensor
    (url,) = engines(model_dir, 1)
    bucket = 12 * 2**20
    out = spawn(rank_sync_memory, 2, model_dir, layout(2, tp=2), url, bucket)
    owner = next(r for r in out if r["owner"])
    assert owner["total"] > 5 * bucket and owner["buckets"] >= 6
    bound = 2 * bucket + owner["largest"]
    assert owner["accounted"] <= bound
    assert owner["peak_rss_extra"] < bound, f"peak RSS +{owner['peak_rss_extra'] / 2**20:.1f} MiB"
    assert owner["peak_rss_extra"] > owner["largest"]  # the measurement sees the sync's buffers


def test_colocated_sequence_hands_memory_over_and_the_engine_follows_training(
    tmp_path: Path, engines: StartEngines
) -> None:
    model_dir = save_asset_model("tiny_dense", tmp_path / "dense")
    (url,) = engines(model_dir, 1)
    out = spawn(rank_colocated_cycles, 2, model_dir, layout(2, tp=2), url)[0]
    for gap, _, sent in out["gaps"]:
        assert gap <= TOLERANCE and sent > 0
    assert [v for _, v, _ in out["gaps"]] == ["c1", "c2"]
    for before, during in out["resident_in_rollout"]:
        assert before > 0 and during == 0  # params, gradients and optimizer state all left the device
    # each offload is followed by free_cached_memory (its gc.collect) before the engine allocates again
    sync = "end_weight_update, flush_cache, update_weight_version"
    for events, memory in out["handovers"]:
        assert events == ["offload state", "gc", "resume weights", sync, "offload params", "gc", "resume kv_cache"]
        assert memory == {"handover/reserved_before_bytes": 0.0, "handover/reserved_after_bytes": 0.0}  # no CUDA
    assert "engine memory ['kv_cache', 'weights'] is released" in out["asleep_error"]  # to_training put it to sleep
    assert "sync/engine_wake_weights_s" in out["timings"] and "sync/trainer_reload_s" in out["timings"]


def test_delta_sync_sends_only_changed_tensors(tmp_path: Path, engines: StartEngines) -> None:
    model_dir = save_asset_model("tiny_dense", tmp_path / "dense")
    (url,) = engines(model_dir, 1)
    out = spawn(rank_delta_sync, 2, model_dir, layout(2, tp=2), url)[0]
    full, one, none, bigger = out["metrics"]
    assert out["replanned"] and bigger.bytes == full.bytes and bigger.buckets < full.buckets
    assert full.bytes_skipped == 0 and full.tensors > 10
    assert one.tensors == 1 and one.bytes == 64 * 64 * 4  # layer 0's o_proj [H, H] fp32
    assert one.bytes_skipped == full.bytes - one.bytes
    assert none.tensors == 0 and none.buckets == 0
    assert one.as_dict()["sync/bytes_skipped"] == one.bytes_skipped and one.as_dict()["sync/gb_per_s"] > 0
    assert out["gap"] <= TOLERANCE
