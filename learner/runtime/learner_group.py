"""The learner's Ray actors: one LearnerActor, or a group of learner.num_learners ranks that split each update by data.

A group's ranks sit in a placement group of their own (packed on one node where they fit, spread over nodes
otherwise) and join one torch.distributed process group: gloo on CPUs; on GPUs NCCL for the tensors on the GPU (the
gradients) and gloo for the few host-side numbers. The rendezvous is torch's TCP store at rank 0's node, on a port
a Ray task picks there. Rank 0 is the learner the rest of the run talks to: it publishes, checkpoints and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.config import ConfigError, RunConfig
from learner.group.ranks import free_address
from learner.runtime.ray_runtime import ResourceRequest

# How long a learner group's placement may wait for its resources, the cluster having shown it holds them in sum
# (learner.runtime.startup.plan_resources): nodes joining, other runs' actors leaving.
PLACEMENT_TIMEOUT_S = 300.0


def rendezvous_address() -> str:
    """tcp://IP:PORT of a port free now on this node (the Ray task's), for rank 0's TCP store."""
    return free_address(ray.util.get_node_ip_address())


@dataclass
class LearnerRanks:
    """The learner's actors, rank 0 first, and the placement group a learner group holds."""

    actors: list[Any]
    group: PlacementGroup | None = None
    nodes: list[str] = field(default_factory=list)  # each rank's node address, for a group

    def kill(self) -> None:
        """Every rank killed (a group's survivors would wait in their collectives for the one gone), the placement freed."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)

    def where(self) -> str:
        """Where each rank runs, for the start-up's line."""
        return ", ".join(f"rank {rank} on {node}" for rank, node in enumerate(self.nodes))


def on_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def start_learner_group(config: RunConfig, request: ResourceRequest, actor_class: Any, *args: Any, **kwargs: Any) -> LearnerRanks:
    """learner.num_learners ranks of `actor_class(*args, **kwargs, group=...)`, each with `request`'s resources."""
    size = config.learner.num_learners
    group = placement_group([request.amounts()] * size, strategy="PACK")
    if not group.wait(PLACEMENT_TIMEOUT_S):
        remove_placement_group(group)
        raise ConfigError(
            f"the learner group of {size} ranks, each {request.amounts()}, could not be placed within "
            f"{PLACEMENT_TIMEOUT_S:g}s: the Ray cluster offers {ray.available_resources()} now"
        )
    address = ray.get(ray.remote(rendezvous_address).options(num_cpus=0, scheduling_strategy=on_bundle(group, 0)).remote())
    options = {"num_cpus": request.num_cpus, "num_gpus": request.num_gpus, "resources": dict(request.resources)}
    actors = [
        ray.remote(actor_class)
        .options(**options, scheduling_strategy=on_bundle(group, rank))
        .remote(*args, **kwargs, group=(address, rank, size))
        for rank in range(size)
    ]
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    node_addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return LearnerRanks(actors, group, [node_addresses.get(table[rank], "?") for rank in range(size)])
