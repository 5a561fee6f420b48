"""Placement read from Ray: where each bundle landed (node, physical GPU), ranks and engine replicas
taking devices in that order, and each engine seeing exactly its own GPUs. Ray's GPUs here are
declared (fake) resources, which Ray assigns ids to exactly as it does real ones."""

import tempfile
from collections.abc import Iterator

import pytest
import ray
from conftest import compose_config

from megarl.engines.replicas.launch import engine_layout, replica_placement
from megarl.engines.replicas.placement import BundleSite, here
from megarl.engines.replicas.sglang_command import SGLangServerArgs, replica_node_args
from megarl.workers.placement import create_pool, make_pools


@pytest.fixture(scope="module")
def fake_gpu_ray() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp_dir:
        ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, _temp_dir=temp_dir)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.mark.usefixtures("fake_gpu_ray")
def test_pool_sites_come_from_ray_and_ranks_use_them_in_order() -> None:
    pool = create_pool("fake", num_devices=4, devices_per_node=4, device="cuda")
    try:
        sites = pool.sites
        assert sorted(g for s in sites for g in s.gpu_ids) == ["0", "1", "2", "3"]
        assert [s.gpu_ids for s in sites] == sorted((s.gpu_ids for s in sites), key=lambda ids: int(ids[0]))
        assert len({s.node_id for s in sites}) == 1 and sorted(s.index for s in sites) == [0, 1, 2, 3]
        probe = ray.remote(here)  # as a role process asks for its share of rank r's bundle
        seen = ray.get(
            [probe.options(num_gpus=0.2, num_cpus=0.2, scheduling_strategy=pool.strategy(r)).remote() for r in range(4)]
        )
        assert [gpus for _, _, gpus in seen] == [list(s.gpu_ids) for s in sites]  # rank r runs on sites[r]'s GPU
    finally:
        pool.remove()


@pytest.mark.usefixtures("fake_gpu_ray")
@pytest.mark.parametrize(
    ("placement", "sizes"), [(["trainer.placement=separate", "trainer.rollout_devices=1"], (3, 1)), ([], (4,))]
)
def test_pools_are_sized_in_devices_and_disjoint(placement: list[str], sizes: tuple[int, ...]) -> None:
    """One node of 4 GPUs: separate gives the trainer 3 and the rollout 1, on GPUs of their own."""
    pools = make_pools(compose_config("trainer.devices_per_node=4", *placement))
    try:
        assert (
            tuple(p.num_devices for p in pools.values()) == sizes and list(pools) == ["train", "rollout"][: len(sizes)]
        )
        gpus = [g for pool in pools.values() for site in pool.sites for g in site.gpu_ids]
        assert sorted(gpus) == ["0", "1", "2", "3"]  # every device once: the pools share none
    finally:
        for pool in pools.values():
            pool.remove()


def _site(index: int, node: str, gpu: int) -> BundleSite:
    return BundleSite(index=index, node_id=node, node_ip=f"10.0.0.{node[-1]}", gpu_ids=(str(gpu),))


# Two nodes of 4 GPUs, ours are physical GPUs 4-7 (another job has 0-3), bundles numbered by Ray at will.
SITES = [_site(i, "node1", g) for i, g in zip((5, 2, 7, 0), (4, 5, 6, 7), strict=True)] + [
    _site(i, "node2", g) for i, g in zip((1, 3, 4, 6), (4, 5, 6, 7), strict=True)
]


def test_replicas_take_their_sites_and_see_exactly_their_gpus() -> None:
    cfg = compose_config("rollout=sglang", "rollout.tensor_parallel_size=2").rollout
    layout = engine_layout(cfg, num_devices=8, devices_per_node=4)
    where = replica_placement(layout, 1, SITES, "cuda")
    assert where.bundles == [7] and where.node_envs == [{"CUDA_VISIBLE_DEVICES": "6,7"}] and where.own_devices_only
    base = SGLangServerArgs(model_path="/m", tp_size=2)
    (args,) = replica_node_args(base, layout, 1, ["10.0.0.1"], 30000, 20000, where.own_devices_only)
    assert args.base_gpu_id == 0  # the server sees GPUs 6,7 as its 0,1
    wide = engine_layout(compose_config("rollout=sglang", "rollout.tensor_parallel_size=8").rollout, 8, 4)
    spanning = replica_placement(wide, 0, SITES, "cuda")
    assert spanning.bundles == [5, 1]
    assert spanning.node_envs == [{"CUDA_VISIBLE_DEVICES": "4,5,6,7"}] * 2


def test_a_replica_split_unevenly_across_nodes_is_refused() -> None:
    cfg = compose_config("rollout=sglang", "rollout.tensor_parallel_size=4").rollout
    layout = engine_layout(cfg, num_devices=8, devices_per_node=4)
    uneven = [SITES[0], SITES[1], SITES[2], SITES[4], SITES[3], *SITES[5:]]  # node1 has 3 of replica 0's 4
    with pytest.raises(RuntimeError, match="landed on 2 node"):
        replica_placement(layout, 0, uneven, "cuda")


def test_without_sites_servers_see_the_whole_node() -> None:
    cfg = compose_config("rollout=sglang", "rollout.tensor_parallel_size=2").rollout
    where = replica_placement(engine_layout(cfg, 8, 4), 1, None, "cuda")
    assert where.bundles is None and where.node_envs == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"}]
    assert not where.own_devices_only
