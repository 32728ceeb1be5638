"""The files a run's learner and rollout actors read by path, checked on every node of a multi-node Ray before any of
them starts.

The nodes of a cluster share no file system unless one is mounted: a model directory copied onto some nodes only
would fail the start of whichever actor lands elsewhere, minutes in, with a traceback from that node. Here a task on
each node that can host one (a node with CPUs or GPUs) looks for every directory the config names, and the first
missing one is refused in one line naming the node and the field. `~` is expanded on each node, as the actors there
expand it. On one node the input checks (learner.runtime.startup.preflight) have looked already.
"""

from __future__ import annotations

from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from common.config import ConfigError, RunConfig

# The fields of a VLA's config section that name local directories (common/policy/*/config.py).
LOCAL_DIRECTORY_FIELDS = ("lerobot_checkpoint", "vlm_path", "tokenizer_path")


def paths_every_node_reads(config: RunConfig) -> dict[str, str]:
    """field -> path for each directory the config names that the learner or an actor reads on its own node: a VLA's
    lerobot checkpoint, backbone and tokenizer directories. (The starting checkpoint and the run directory stay on the
    driver's node, and reach the others through actors.run_files.)"""
    section = config.policy.vla_section()
    if section is None:
        return {}
    settings = getattr(config.policy, section)
    return {f"policy.{section}.{name}": getattr(settings, name) for name in LOCAL_DIRECTORY_FIELDS if getattr(settings, name, "")}


def missing_here(paths: dict[str, str]) -> dict[str, str]:
    """The entries of `paths` that do not exist on the node this runs on."""
    return {field: path for field, path in paths.items() if not Path(path).expanduser().exists()}


def check_every_node_holds(paths: dict[str, str]) -> None:
    """ConfigError naming the first node (its address and Ray node id) that lacks one of `paths` (what -> path: those
    of paths_every_node_reads, or the starting checkpoint a run resolved itself)."""
    nodes = [node for node in ray.nodes() if node["Alive"] and (node["Resources"].get("CPU", 0) > 0 or node["Resources"].get("GPU", 0) > 0)]
    if not paths or len(nodes) < 2:
        return
    probe = ray.remote(missing_here)
    answers = ray.get(
        [
            probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(paths)
            for node in nodes
        ]
    )
    for node, missing in zip(nodes, answers):
        if missing:
            field, path = next(iter(missing.items()))
            others = f" (and {len(missing) - 1} more of the {len(paths)} directories the run reads)" if len(missing) > 1 else ""
            raise ConfigError(
                f"node {node['NodeManagerAddress']} (Ray node {node['NodeID'][:8]}) has no {path!r} ({field}){others}: every node "
                "that may host the learner or a rollout actor reads it; copy it there (a cluster YAML's file_mounts do) "
                "or keep it on a file system every node mounts at that path"
            )
