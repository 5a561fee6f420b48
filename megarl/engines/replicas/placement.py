"""Where the bundles of a Ray placement group landed: node and physical GPU ids, read from Ray.

Ray guarantees neither that bundle i sits on node i // devices_per_node nor which GPU a bundle
holds, so nothing may assume either. `locate_bundles` asks Ray by running a tiny probe task in each
bundle; the result is sorted node by node, GPU id by GPU id, which is the order ranks and replicas
take devices in::

    sites = locate_bundles(group, num_devices=16, device="cuda")
    sites[0]  # BundleSite(index=5, node_id='ab…', node_ip='10.0.0.1', gpu_ids=('0',))
"""

from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PROBE_SHARE = 0.01
"""Share of a bundle's CPU (and GPU) the probe task holds while it runs."""


@dataclass(frozen=True, slots=True)
class BundleSite:
    index: int
    """The bundle's index in its placement group."""
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    """Physical GPU ids Ray gave the bundle (what CUDA_VISIBLE_DEVICES names); empty on CPU."""


def here() -> tuple[str, str, list[str]]:
    """(node id, node IP, GPU ids Ray gave this process) of the calling Ray task or actor."""
    context = ray.get_runtime_context()
    return context.get_node_id(), str(ray.util.get_node_ip_address()), [str(g) for g in ray.get_gpu_ids()]


def locate_bundles(group: PlacementGroup, num_bundles: int, device: str) -> tuple[BundleSite, ...]:
    """Every bundle's site, sorted by node, then by GPU id (then by index)."""
    probe = ray.remote(here)
    share = {"num_cpus": PROBE_SHARE, "num_gpus": PROBE_SHARE if device == "cuda" else 0}
    strategies = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(num_bundles)]
    refs = [probe.options(**share, scheduling_strategy=strategy).remote() for strategy in strategies]
    sites = [BundleSite(i, node, ip, tuple(gpus)) for i, (node, ip, gpus) in enumerate(ray.get(refs))]
    return tuple(sorted(sites, key=lambda s: (s.node_ip, s.node_id, [int(g) for g in s.gpu_ids], s.index)))


def memory_site(site: BundleSite, device: str) -> str:
    """Where a process on `site` keeps memory it can hand out by handle: its node on CPU (named shared
    memory is node-local), its node's GPU on CUDA (an IPC handle names one device)."""
    return f"{site.node_id}/gpu{','.join(site.gpu_ids)}" if device == "cuda" else site.node_id


def node_groups(sites: Sequence[BundleSite]) -> list[list[BundleSite]]:
    """Consecutive sites split where the node changes (one list per node, in order)."""
    groups: list[list[BundleSite]] = []
    for site in sites:
        if groups and groups[-1][0].node_id == site.node_id:
            groups[-1].append(site)
        else:
            groups.append([site])
    return groups
