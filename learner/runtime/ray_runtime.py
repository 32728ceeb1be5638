"""The driver's side of Ray: what each actor asks for, and which Ray the run uses.

Resource requests (`learner_request`, `actor_request`) live here so that the driver and the offline cluster check
(learner.runtime.cluster_yaml) ask Ray for the same amounts. The run either joins a cluster (`cluster_to_join`, refused at once
when nothing answers at the address) or starts a local Ray whose every port is on 127.0.0.1 (`start_local_ray`).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.util import get_current_placement_group, get_node_ip_address
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.config import ConfigError, RunConfig

LOOPBACK = "127.0.0.1"
LOOPBACK_MODE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's loopback-only mode (start_local_ray)
# How long a Ray address may take to accept a TCP connection, and then to answer as a gRPC server, before the run is
# refused: a live GCS answers in milliseconds, even across regions.
GCS_PROBE_TIMEOUT_S = 10.0
# Fixed-point unit of Ray's resource accounting (it rounds requests to 1e-4).
RESOURCE_UNIT = 10_000

# A run inside a placement group (learner.sweep's trials) finds its bundles in this order: the trial's own
# process, the learner, then one per rollout actor.
LEARNER_BUNDLE, FIRST_ACTOR_BUNDLE = 1, 2


@dataclass(frozen=True)
class ResourceRequest:
    """What one Ray actor asks for; `amounts()` is the bundle the placement check packs."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)

    def amounts(self) -> dict[str, float]:
        return {k: v for k, v in {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}.items() if v > 0}

    def times(self, count: int) -> ResourceRequest:
        """What `count` actors with this request hold together."""
        return ResourceRequest(self.num_cpus * count, self.num_gpus * count, {k: v * count for k, v in self.resources.items()})

    def options(self, bundle_index: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `ray.remote(...).options(...)`.

        Inside a placement group (a sweep trial), `bundle_index` pins the actor to its own bundle. Left to
        Ray's any-bundle default, the learner may take part of an actor's bundle, and the last actor, which
        needs a whole bundle, then stays pending forever although the group has room in sum.
        """
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}
        group = get_current_placement_group()
        if group is not None and bundle_index is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index)
        return options


def learner_request(config: RunConfig, cluster_cpus: float) -> ResourceRequest:
    """learner.num_cpus, or a quarter of the cluster's CPUs capped at 0.5 (on CPU the update is short next to sampling)."""
    cpus = config.learner.num_cpus if config.learner.num_cpus is not None else min(0.5, cluster_cpus / 4)
    return ResourceRequest(cpus, config.learner.num_gpus, dict(config.learner.resources))


def actor_request(config: RunConfig, node_cpus: Sequence[float]) -> ResourceRequest:
    """actors.num_cpus, or an even split of the CPUs of the nodes up now (`node_cpus`, one entry per node).

    The split is the largest per-actor amount (in Ray's 1e-4 units) for which every actor fits whole on
    some node, after taking the learner's CPUs (every rank's) off each node (it may land on any): on one machine that
    is (CPUs - learner) / actors; across nodes, dividing the total instead would leave a fragment on
    each node and the last actors pending forever.
    """
    if config.actors.num_cpus is not None:
        return ResourceRequest(config.actors.num_cpus, config.actors.num_gpus, dict(config.actors.resources))
    learner_units = round(learner_request(config, sum(node_cpus)).num_cpus * RESOURCE_UNIT) * config.learner.num_learners
    free = [max(0, round(c * RESOURCE_UNIT) - learner_units) for c in node_cpus]
    low, high = 1, max(free, default=0) or 1  # low always counts as fitting (Ray's smallest request)
    while low < high:  # largest per-actor amount with sum(floor(free / amount)) >= num_actors
        mid = (low + high + 1) // 2
        if sum(f // mid for f in free) >= config.actors.num_actors:
            low = mid
        else:
            high = mid - 1
    return ResourceRequest(low / RESOURCE_UNIT, config.actors.num_gpus, dict(config.actors.resources))


def node_cluster_address() -> str | None:
    """The cluster that `ray start` left on this machine (what a bare `ray.init()` joins: the address in
    ray/ray_current_cluster of Ray's temporary directory, RAY_TMPDIR or the system's), else None."""
    try:
        return (Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def dialled_address(address: str) -> str | None:
    """HOST:PORT that ray.init dials for `address`: None for "local" (it starts a Ray) and for "auto" with no cluster on
    this node; the node's cluster for "auto"; a loopback host as this machine's address, as Ray resolves it outside its
    loopback-only mode. ValueError where `address` is not HOST:PORT."""
    if address == "local":
        return None
    if address == "auto":
        address = node_cluster_address()
        if address is None:
            return None
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"Invalid address format: {address}")
    if host in ("localhost", LOOPBACK) and os.environ.get(LOOPBACK_MODE_VARIABLE) != "0":
        host = get_node_ip_address()
    return f"{host}:{port}"


def cluster_to_join(address: str | None) -> str | None:
    """The Ray cluster a run joins: `address`, else RAY_ADDRESS, else the cluster this node's `ray start` left; None
    when there is none (a local Ray is started). Refused at once when nothing answers there (check_reachable)."""
    source = "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "this node's Ray cluster file"
    address = address or os.environ.get("RAY_ADDRESS") or node_cluster_address()
    if address:
        check_reachable(address, source)
    return address or None


def connect_ray(address: str | None, include_dashboard: bool) -> bool:
    """Join the cluster at `address` (cluster_to_join's answer), or start a local Ray on loopback when it is None.
    True when this call started or joined Ray (False: this process was connected already)."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        start_local_ray(include_dashboard=include_dashboard, log_to_driver=True)
    return True


def check_reachable(address: str, source: str, timeout_s: float | None = None) -> None:
    """ConfigError naming `address` (and `source`, where it came from) when its port takes no TCP connection, or takes
    one but answers no gRPC handshake (a port of something other than Ray), within `timeout_s` (GCS_PROBE_TIMEOUT_S):
    ray.init would retry an absent GCS for minutes, and Ray 2.60's init takes no deadline of its own.
    The port probed is the one ray.init dials: a loopback host becomes this machine's address, as Ray resolves it;
    a Ray Client address (ray://HOST:PORT) is dialled as given."""
    try:
        target = address.removeprefix("ray://") if address.startswith("ray://") else dialled_address(address)
    except ValueError as exc:
        raise ConfigError(f"{source} {address}: {exc}; expected HOST:PORT (the head node's GCS port, 6379 by default)") from None
    if target is None:  # "local", or "auto" with no cluster found: ray.init starts or refuses at once
        return
    host, _, port = target.rpartition(":")
    timeout_s = GCS_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        reason = f"no answer within {timeout_s:g}s" if isinstance(exc, TimeoutError) else getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(
            f"{source} {address}: no Ray cluster answers at {target} ({reason}): start one there (ray start --head) or correct the address"
        ) from None
    import grpc  # Ray's GCS and its client server speak gRPC: a port that takes TCP but not HTTP/2 is something else

    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConfigError(
                f"{source} {address}: {target} takes connections but answers no Ray handshake within {timeout_s:g}s: "
                "it is not a Ray head node's GCS port (6379 by default); correct the address"
            ) from None


def start_local_ray(**init_kwargs: Any) -> Any:
    """Start a single-machine Ray whose every port (GCS, raylet, dashboard, agents, metrics export) is on 127.0.0.1.

    `ray.init(_node_ip_address="127.0.0.1")` alone is not enough on Linux: Ray resolves a loopback node
    address to the machine's routable one (services.resolve_ip_for_localhost), and its servers then
    listen on every interface. Ray's loopback-only mode, the one it uses on macOS and Windows
    (ray_constants.ENABLE_RAY_CLUSTER off, environment RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), keeps the
    node address at 127.0.0.1; the environment variable reaches the processes ray.init spawns, and
    the flag is restored afterwards. Token auth stays at Ray's default (on; token in ~/.ray/auth_token).

    Its workers start at the driver's niceness instead of Ray's 15 (RAY_worker_niceness=0, read by the raylet), so
    that the learner keeps the driver's priority while the rollout actors lower their own (learner.runtime.startup.ACTOR_NICENESS):
    only a privileged process can raise its priority again, and the learner's update is the iteration's critical path
    where actors and learner share the cores. cluster/*.yaml start their nodes' Ray the same way.
    """
    import ray

    # Ray 2.60 has no public setting for this mode: the driver's own copy of the flag, read when ray.init resolves the
    # node's address, is set for the call alone (docs/decisions.md, "Ray's public API").
    from ray._private import ray_constants

    environment = {LOOPBACK_MODE_VARIABLE: "0", "RAY_worker_niceness": "0"}
    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, {name: os.environ.get(name) for name in environment}
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ.update(environment)
    try:
        return ray.init(address="local", _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **init_kwargs)  # its RayContext
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
