"""Resource pools: Ray placement groups of one bundle per device, shared by the roles mapped to them.

    pools = make_pools(cfg)     # {"train": ..., "rollout": ...} ("rollout" only if separate; "judge", "classifier")
    pool = pools["train"]
    actor = WorkerGroup(ActorWorker, pool, "actor")          # one Ray actor per bundle
    critic = WorkerGroup(CriticWorker, pool, "critic")       # colocated: the same bundles

A bundle holds one device (a GPU, or on CPU one slot). Every process placed on a bundle asks for
`ROLE_SHARE` of it, so up to `1 / ROLE_SHARE` roles (actor, critic, reference, reward model, the
colocated engine) fit on one device; the device itself is shared, not split.
"""

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.config.root import MegarlConfig
from megarl.engines.replicas.placement import BundleSite, locate_bundles
from megarl.plan.facts import reward_pool_devices, rollout_devices, training_devices

ROLE_SHARE = 0.2
"""Fraction of a bundle's CPU/GPU each colocated process reserves (5 processes per device)."""


@dataclass(frozen=True, slots=True)
class ResourcePool:
    """`num_devices` bundles, `devices_per_node` per node; `sites` says where each landed, in rank order."""

    name: str
    group: PlacementGroup
    num_devices: int
    devices_per_node: int
    device: str
    sites: tuple[BundleSite, ...]
    """Sorted by node, then GPU id: rank r of every role group uses the bundle of `sites[r]`."""

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.sites[rank].index)

    def share(self) -> dict[str, float]:
        """Ray resource options of one colocated process on a bundle."""
        return {"num_cpus": ROLE_SHARE, "num_gpus": ROLE_SHARE if self.device == "cuda" else 0.0}

    def remove(self) -> None:
        ray.util.remove_placement_group(self.group)


def create_pool(
    name: str, num_devices: int, devices_per_node: int, device: str, timeout_s: float = 300.0
) -> ResourcePool:
    """Reserve the bundles and wait for them; a cluster without room fails with the counts it wanted."""
    bundle = {"CPU": 1.0, "GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK", name=f"megarl-{name}")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"resource pool {name!r}: Ray could not reserve {num_devices} bundles of {bundle} within {timeout_s:.0f}s; "
            f"the cluster has {ray.cluster_resources()} — check trainer.nnodes / trainer.devices_per_node"
        )
    return ResourcePool(name, group, num_devices, devices_per_node, device, locate_bundles(group, num_devices, device))


def make_pools(cfg: MegarlConfig) -> dict[str, ResourcePool]:
    """`train` for the Megatron roles (and the engines when colocated): every device but the reward pools', less
    `trainer.rollout_devices` when separate; then `rollout`, those devices, for separate engines; then one pool per
    reward model with engines of its own (`judge`, `classifier`: `reward_pool_devices`). All are PACKed (as few
    nodes as Ray can), so one machine can hold several; `sites` says where each bundle landed."""
    t = cfg.trainer
    pools = {"train": create_pool("train", training_devices(cfg), t.devices_per_node, t.device)}
    if t.placement == "separate":
        pools["rollout"] = create_pool("rollout", rollout_devices(cfg), t.devices_per_node, t.device)
    for name, num_devices in reward_pool_devices(cfg).items():
        pools[name] = create_pool(name, num_devices, t.devices_per_node, t.device)
    return pools
