"""Colocated sync across nodes and devices: each engine rank maps memory at its own site, never another's.

The holder table is checked on synthetic sites (two nodes on CPU, two GPUs per node). Then a
two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`) runs a TP=2 role with one rank
per node, and one embedded engine per node placed from Ray (`launch_engines` with the pool's sites).
Named shared memory would open across these two "nodes", since they share one /dev/shm, so the
test reads where each handle came from: torch names shared memory after the pid that created it,
and each engine logs the pids whose memory it mapped.
"""

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from cases.megatron_cases import layout, save_asset_model
from cases.sync_cases import RelayRank
from conftest import REPO, compose_config
from ray.cluster_utils import Cluster

from megarl.config.sync import SyncConfig, delivery
from megarl.engines.client.auth import EngineKeys
from megarl.engines.replicas.launch import launch_engines
from megarl.engines.replicas.placement import memory_site
from megarl.sync.build import engine_targets
from megarl.sync.relay import holders, needs_relay, remote_holders
from megarl.sync.transport import EngineTarget
from megarl.workers.group import WorkerGroup
from megarl.workers.placement import ROLE_SHARE, create_pool

TOLERANCE = 1e-4


def test_each_engine_rank_is_served_from_its_own_node_on_cpu() -> None:
    sites = ("A", "A", "B", "B")
    targets = [EngineTarget("http://a", 1, ("A",)), EngineTarget("http://b", 1, ("B",))]
    assert holders(0, sites, targets) == [[0], [2]]
    assert holders(1, sites, targets) == [[1], [2]]  # the owner serves its own node itself
    assert holders(3, sites, targets) == [[0], [3]]
    assert remote_holders(0, sites, targets) == [2] and remote_holders(3, sites, targets) == [0]


def test_each_engine_rank_is_served_from_its_own_gpu() -> None:
    sites = ("A/gpu0", "A/gpu1", "B/gpu0", "B/gpu1")
    targets = [EngineTarget("http://a", 2, sites[:2]), EngineTarget("http://b", 2, sites[2:])]
    for owner in range(4):
        assert holders(owner, sites, targets) == [[0, 1], [2, 3]]
    assert remote_holders(1, sites, targets) == [0, 2, 3]


def test_without_sites_the_owner_serves_everyone() -> None:
    targets = [EngineTarget("http://a", 2), EngineTarget("http://b", 1)]
    assert holders(1, ("A", "B"), targets) == [[1, 1], [1]]
    assert not needs_relay(2, ("A", "B"), targets)
    assert not needs_relay(2, (), [EngineTarget("http://a", 1, ("A",))])


def test_an_engine_rank_without_a_trainer_rank_at_its_site_is_refused() -> None:
    with pytest.raises(ValueError, match=r"http://c rank 0 runs at C, where no trainer rank runs.*separate"):
        holders(0, ("A", "B"), [EngineTarget("http://c", 1, ("C",))])
    with pytest.raises(ValueError, match="1 device sites for 2 TP ranks"):
        holders(0, ("A", "B"), [EngineTarget("http://a", 2, ("A",))])


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """Two Ray nodes of one CPU each; their workers import the test helpers."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), previous]))
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp_dir:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": temp_dir}
        )
        try:
            cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, include_dashboard=False)
            yield
        finally:
            ray.shutdown()
            cluster.shutdown()
            if previous is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = previous


def _mapped_pids(log: Path) -> set[int]:
    lines = re.findall(r"mapped from shared memory of pid \[([\d, ]+)\]", log.read_text())
    return {int(pid) for line in lines for pid in line.split(",")}


@pytest.mark.usefixtures("two_nodes")
def test_no_handle_crosses_a_node_and_both_engines_get_the_weights(tmp_path: Path) -> None:
    model_dir = save_asset_model("tiny_dense", tmp_path / "model")
    cfg = compose_config(f"model.path={model_dir}")
    pool = create_pool("relay", num_devices=2, devices_per_node=1, device="cpu")
    fleet = None
    try:
        assert len({site.node_id for site in pool.sites}) == 2
        cfg.rollout.load_format = "dummy"  # the sync, not the checkpoint, must bring the weights
        fleet = launch_engines(
            cfg.rollout, cfg.model, num_devices=2, devices_per_node=1, device="cpu", log_dir=tmp_path / "engines",
            keys=EngineKeys(), placement_group=pool.group, sites=pool.sites, multi_node=True, num_cpus=ROLE_SHARE,
        )  # fmt: skip
        targets = engine_targets(cfg.rollout, fleet.urls, fleet.sites)
        rank_sites = tuple(memory_site(site, "cpu") for site in pool.sites)
        ranks = WorkerGroup(RelayRank, pool, "relay")
        try:
            results = ranks.broadcast(RelayRank.sync_once, model_dir, layout(2, tp=2), targets, rank_sites)
        finally:
            ranks.shutdown()
        for r, replica in enumerate(fleet.replicas):
            engine_node = pool.sites[r].node_id
            (local_rank,) = [res for res in results if res["node"] == engine_node]
            assert _mapped_pids(Path(replica.log_paths[0])) == {local_rank["pid"]}, (r, results)
        assert all(res["relay"] for res in results)
        for url in fleet.urls:
            gap, version = results[0]["gaps"][url]
            assert gap <= TOLERANCE and version == "relayed", (url, gap, version)
    finally:
        if fleet is not None:
            fleet.stop()
        pool.remove()


def test_the_plan_says_how_weights_reach_the_engines() -> None:
    colocated = SyncConfig()
    assert "directly" in delivery(colocated, "colocated", "cpu", nnodes=1, num_devices=2)
    assert "one trainer rank on every other node" in delivery(colocated, "colocated", "cpu", nnodes=2, num_devices=2)
    assert "its own GPU" in delivery(colocated, "colocated", "cuda", nnodes=1, num_devices=8)
    assert delivery(colocated, "separate", "cuda", nnodes=2, num_devices=8).startswith("broadcast")
