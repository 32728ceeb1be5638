"""Ray cluster-launcher configs (cluster/*.yaml): offline checks and the planned placement.

`python -m learner.main --check-cluster cluster/h200.yaml` runs this before anything starts:

1. Ray's own checks, in the order `ray up` runs them: `prepare_config` (defaults, node types, worker
   counts), then `validate_config` (the schema).
2. What Ray leaves to the cloud API or never checks: the names of the node_config fields this
   project relies on (Ray hands node_config to EC2 untouched, so a typo such as `InstanceTyp` only
   fails at launch, or silently drops a disk size), negative or inverted worker counts, a dashboard
   opened to the network, token auth switched off, and node types without explicit resources.
3. Whether the run config's learner and rollout actors fit the node types, as a concrete first-fit
   plan over the cluster at its largest (every worker type at max_workers). Ray's scheduler may
   spread actors differently over nodes of the same type; the plan proves that a placement exists
   and shows which node type hosts what. The requests are the driver's own (learner.runtime.ray_runtime).
"""

from __future__ import annotations

import copy
import difflib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from common.config import ConfigError, RunConfig
from common.config_loading import read_yaml_file
from learner.files.node_files import paths_every_node_reads
from learner.runtime.ray_runtime import RESOURCE_UNIT, ResourceRequest, actor_request, learner_request

# Top-level parameters of EC2 RunInstances, which Ray's AWS provider passes node_config to verbatim
# (plus Ray's own SubnetIds). Anything else is a typo that EC2 would reject at launch or ignore.
AWS_NODE_CONFIG_FIELDS = frozenset(
    {
        "AdditionalInfo",
        "BlockDeviceMappings",
        "CapacityReservationSpecification",
        "ClientToken",
        "CpuOptions",
        "CreditSpecification",
        "DisableApiStop",
        "DisableApiTermination",
        "EbsOptimized",
        "ElasticGpuSpecification",
        "ElasticInferenceAccelerators",
        "EnablePrimaryIpv6",
        "EnclaveOptions",
        "HibernationOptions",
        "IamInstanceProfile",
        "ImageId",
        "InstanceInitiatedShutdownBehavior",
        "InstanceMarketOptions",
        "InstanceType",
        "Ipv6AddressCount",
        "Ipv6Addresses",
        "KernelId",
        "KeyName",
        "LaunchTemplate",
        "LicenseSpecifications",
        "MaintenanceOptions",
        "MetadataOptions",
        "Monitoring",
        "NetworkInterfaces",
        "NetworkPerformanceOptions",
        "Placement",
        "PrivateDnsNameOptions",
        "PrivateIpAddress",
        "RamdiskId",
        "SecurityGroupIds",
        "SecurityGroups",
        "SubnetId",
        "SubnetIds",
        "TagSpecifications",
        "UserData",
    }
)
# Nested fields the project sets (disk size and type, spot market): typos here silently fall back to defaults.
AWS_NESTED_FIELDS = {
    "BlockDeviceMappings[]": frozenset({"DeviceName", "Ebs", "NoDevice", "VirtualName"}),
    "BlockDeviceMappings[].Ebs": frozenset(
        {"DeleteOnTermination", "Encrypted", "Iops", "KmsKeyId", "OutpostArn", "SnapshotId", "Throughput", "VolumeSize", "VolumeType"}
    ),
    "InstanceMarketOptions": frozenset({"MarketType", "SpotOptions"}),
}
AWS_REQUIRED_FIELDS = ("InstanceType", "ImageId", "BlockDeviceMappings")  # the GPU image and a disk that holds torch

# vCPUs and GPUs of the instance types the shipped configs use (AWS's published specifications), to
# catch declared resources the hardware cannot back. Unknown types are not checked.
AWS_INSTANCE_HARDWARE = {
    "p5en.48xlarge": {"CPU": 192, "GPU": 8},  # 8 x H200
    "p5e.48xlarge": {"CPU": 192, "GPU": 8},  # 8 x H200
    "p5.48xlarge": {"CPU": 192, "GPU": 8},  # 8 x H100
    "m7i.4xlarge": {"CPU": 16, "GPU": 0},
    "m7i.8xlarge": {"CPU": 32, "GPU": 0},
}
# Ports that must never be opened to the internet: dashboard, Grafana, Prometheus, GCS, Ray client, metrics.
PRIVATE_PORTS = {8265: "dashboard", 3000: "Grafana", 9090: "Prometheus", 6379: "GCS", 10001: "Ray client", 8080: "metrics export"}


@dataclass
class NodeType:
    name: str
    instance: str  # instance type (aws) or "on-premise" (local)
    resources: dict[str, float]
    count: int  # nodes of this type when the cluster is at its largest
    is_head: bool


@dataclass
class Placement:
    """A first-fit plan: the node (type#index) of each learner rank and of each actor, and what is left on each node."""

    learners: list[str]
    actors: list[str]
    free: dict[str, dict[str, float]]


# ---------------------------------------------------------------------------------------------- checks


def load_cluster_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    data = read_yaml_file(path, "cluster config")
    if not isinstance(data, dict):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"cluster config {path} must hold a mapping at top level (Ray's cluster-launcher fields), got {found}")
    return data


def ray_prepared(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Ray's own offline checks, in `ray up`'s order: prepare_config, then validate_config."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(copy.deepcopy(raw))
        validate_config(prepared)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "top level"
        raise ConfigError(f"{source}: Ray's schema rejects {where}: {exc.message}") from None
    except Exception as exc:  # ValueError, RuntimeError, click's abort: all mean "ray up would refuse this"
        raise ConfigError(f"{source}: Ray rejects it: {getattr(exc, 'message', None) or exc}") from None
    return prepared


def _unknown_fields(mapping: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    for name in mapping:
        if name not in allowed:
            close = difflib.get_close_matches(name, sorted(allowed), n=1)
            hint = f"did you mean {close[0]}?" if close else f"known fields: {sorted(allowed)}"
            raise ConfigError(f"{where}.{name} is not a field EC2 knows: {hint}")


def check_aws_node_config(name: str, node_config: dict[str, Any], source: str) -> None:
    where = f"{source}: available_node_types.{name}.node_config"
    _unknown_fields(node_config, AWS_NODE_CONFIG_FIELDS, where)
    for required in AWS_REQUIRED_FIELDS:
        if required not in node_config:
            raise ConfigError(f"{where}.{required} is missing: the project relies on it (GPU driver image, disk for torch)")
    for i, mapping in enumerate(node_config["BlockDeviceMappings"]):
        _unknown_fields(mapping, AWS_NESTED_FIELDS["BlockDeviceMappings[]"], f"{where}.BlockDeviceMappings[{i}]")
        _unknown_fields(mapping.get("Ebs", {}), AWS_NESTED_FIELDS["BlockDeviceMappings[].Ebs"], f"{where}.BlockDeviceMappings[{i}].Ebs")
    _unknown_fields(
        node_config.get("InstanceMarketOptions", {}), AWS_NESTED_FIELDS["InstanceMarketOptions"], f"{where}.InstanceMarketOptions"
    )


def check_worker_counts(prepared: dict[str, Any], source: str) -> None:
    """Ray's schema accepts negative counts and min > max; the autoscaler then misbehaves at run time."""
    if prepared.get("max_workers", 0) < 0:
        raise ConfigError(f"{source}: max_workers must be >= 0, got {prepared['max_workers']}")
    for name, node_type in prepared["available_node_types"].items():
        low, high = node_type.get("min_workers", 0), node_type.get("max_workers", 0)
        where = f"{source}: available_node_types.{name}"
        if low < 0 or high < 0:
            raise ConfigError(f"{where}.min_workers/max_workers must be >= 0, got {low}/{high}")
        if low > high:
            raise ConfigError(f"{where}.min_workers ({low}) must not exceed max_workers ({high})")


def check_security(prepared: dict[str, Any], source: str) -> None:
    """The dashboard stays on the head's loopback, no private port is opened to the internet, token auth stays on."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = " ; ".join(prepared.get(key, []))
        if "ray start" not in commands:
            continue
        flags = ray_start_flags(prepared.get(key, []))
        if key == "head_start_ray_commands" and flags.get("--dashboard-host", "127.0.0.1") not in ("127.0.0.1", "localhost"):
            raise ConfigError(
                f"{source}: {key} binds the dashboard to {flags['--dashboard-host']}: use --dashboard-host=127.0.0.1 "
                "and reach it with `ray dashboard <cluster.yaml>` (an SSH port-forward)"
            )
        if "RAY_AUTH_MODE=token" not in commands or "RAY_AUTH_MODE=disabled" in commands:
            raise ConfigError(f"{source}: {key} must start Ray with RAY_AUTH_MODE=token (token auth on every node)")
    for i, rule in enumerate(prepared["provider"].get("security_group", {}).get("IpPermissions", [])):
        ranges = [r.get("CidrIp") for r in rule.get("IpRanges", [])] + [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        if not {"0.0.0.0/0", "::/0"} & set(ranges):
            continue
        low, high = rule.get("FromPort", -1), rule.get("ToPort", -1)
        opened = [f"{port} ({what})" for port, what in PRIVATE_PORTS.items() if low == -1 or low <= port <= high]
        if opened:
            raise ConfigError(
                f"{source}: provider.security_group.IpPermissions[{i}] opens {', '.join(opened)} to the internet: "
                "port-forward over SSH instead (`ray dashboard <cluster.yaml>`)"
            )


def ray_start_flags(commands: list[str]) -> dict[str, str]:
    """`--flag=value` / `--flag value` pairs of the `ray start` invocations in a command list."""
    flags: dict[str, str] = {}
    for command in commands:
        if "ray start" not in command:
            continue
        tokens = shlex.split(command.replace(";", " ; "))
        for i, token in enumerate(tokens):
            if not token.startswith("--"):
                continue
            if "=" in token:
                name, value = token.split("=", 1)
            else:
                name, value = token, tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else ""
            flags[name] = value
    return flags


def local_node_resources(flags: dict[str, str], where: str) -> dict[str, float]:
    """An on-premise node's resources, from its `ray start` flags (the local provider's node type declares none)."""
    if "--num-cpus" not in flags:
        raise ConfigError(
            f"{where} must pass --num-cpus=N (and --num-gpus=G, --resources='{{...}}') to `ray start`: "
            "the local provider detects resources only at start, so the placement check needs them declared"
        )
    try:
        custom = json.loads(flags.get("--resources", "{}"))
        resources = {"CPU": float(flags["--num-cpus"]), "GPU": float(flags.get("--num-gpus", 0)), **custom}
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: cannot read the `ray start` resource flags {flags}: {exc}") from None
    return {k: float(v) for k, v in resources.items()}


def node_types(prepared: dict[str, Any], source: str) -> list[NodeType]:
    """Every node type with the resources each of its nodes offers, the head first."""
    provider = prepared["provider"]["type"]
    head = prepared["head_node_type"]
    if provider == "local":
        (name,) = prepared["available_node_types"]
        workers = prepared["available_node_types"][name]["max_workers"]
        head_flags = ray_start_flags(prepared.get("head_start_ray_commands", []))
        worker_flags = ray_start_flags(prepared.get("worker_start_ray_commands", []))
        return [
            NodeType("head", "on-premise", local_node_resources(head_flags, f"{source}: head_start_ray_commands"), 1, True),
            NodeType("worker", "on-premise", local_node_resources(worker_flags, f"{source}: worker_start_ray_commands"), workers, False),
        ]
    if provider != "aws":
        raise ConfigError(f"{source}: provider.type {provider!r}: the project's checks cover 'aws' and 'local'")
    types = []
    for name, spec in sorted(prepared["available_node_types"].items(), key=lambda item: item[0] != head):
        check_aws_node_config(name, spec["node_config"], source)
        resources = {k: float(v) for k, v in spec["resources"].items()}
        instance = spec["node_config"]["InstanceType"]
        hardware = AWS_INSTANCE_HARDWARE.get(instance)
        where = f"{source}: available_node_types.{name}.resources"
        if name != head and not {"CPU", "GPU"} <= set(resources):
            raise ConfigError(f"{where} must declare CPU and GPU explicitly (the autoscaler plans with them), got {spec['resources']}")
        for key in ("CPU", "GPU"):
            if hardware is not None and resources.get(key, 0) > hardware[key]:
                raise ConfigError(f"{where}.{key}={resources[key]:g} but {instance} has {hardware[key]}")
        count = 1 if name == head else spec["max_workers"]
        types.append(NodeType(name, instance, resources, count, name == head))
    return types


# -------------------------------------------------------------------------------------------- placement


def _units(amounts: dict[str, float]) -> dict[str, int]:
    return {k: round(v * RESOURCE_UNIT) for k, v in amounts.items()}


def plan_placement(
    types: list[NodeType],
    learner: ResourceRequest,
    actor: ResourceRequest,
    num_actors: int,
    source: str,
    even_split_cpus: bool = False,
    num_learners: int = 1,
) -> Placement:
    """First fit: each learner rank, then each actor, onto the first node with room (a learner group's placement group
    packs its ranks so too). Raises ConfigError naming the field.

    even_split_cpus: the actors' CPUs were derived (actors.num_cpus unset); only changes the hint of the error.
    """
    for section, request in (("learner", learner), ("actors", actor)):
        for name in request.resources:
            if not any(t.resources.get(name, 0) > 0 for t in types):
                raise ConfigError(
                    f"{section}.resources.{name}: no node type in {source} declares {name!r}; "
                    f"declared: {sorted({k for t in types for k in t.resources})}"
                )
    free = {f"{t.name}#{i}": _units(t.resources) for t in types for i in range(t.count)}

    def place(request: ResourceRequest, what: str, field_name: str) -> str:
        need = _units(request.amounts())
        for node, left in free.items():
            if all(left.get(k, 0) >= v for k, v in need.items()):
                for k, v in need.items():
                    left[k] -= v
                return node
        short = {n: {k: (v - left.get(k, 0)) / RESOURCE_UNIT for k, v in need.items() if left.get(k, 0) < v} for n, left in free.items()}
        hint = "lower the request or raise a node type's max_workers"
        if field_name == "actors" and even_split_cpus:
            hint = "actors.num_cpus is unset, so CPUs are split evenly over the actors, leaving a fragment per node: set actors.num_cpus"
        raise ConfigError(
            f"{what} does not fit: it asks {request.amounts()} ({field_name}.num_cpus/num_gpus/resources) and each node "
            f"lacks {short} at the cluster's largest size; {hint}"
        )

    learner_nodes = [
        place(learner, "the learner" if num_learners == 1 else f"learner rank {rank} (of {num_learners})", "learner")
        for rank in range(num_learners)
    ]
    actor_nodes = [place(actor, f"rollout actor {i} (of {num_actors})", "actors") for i in range(num_actors)]
    return Placement(learner_nodes, actor_nodes, {n: {k: v / RESOURCE_UNIT for k, v in left.items()} for n, left in free.items()})


def _fmt(amounts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in amounts.items()) + "}"


def describe(source: str, provider: str, types: list[NodeType], learner: ResourceRequest, actor: ResourceRequest, plan: Placement) -> str:
    lines = [f"cluster {source} (provider {provider}): Ray's prepare_config + validate_config and the project's checks passed"]
    lines.append("node types:")
    for t in types:
        role = "head" if t.is_head else f"worker, up to {t.count}"
        lines.append(f"  {t.name:<12} {t.instance:<15} ({role}): {_fmt(t.resources)} each")
    lines.append("planned placement (first fit, every worker type at max_workers):")
    for rank, node in enumerate(plan.learners):
        name = "learner" if len(plan.learners) == 1 else f"learner rank {rank}"
        lines.append(f"  {name:<17} -> {node}  asks {_fmt(learner.amounts())}")
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(plan.actors):
        by_node.setdefault(node, []).append(i)
    for node, indices in by_node.items():
        lines.append(f"  actors {_ranges(indices):<10} -> {node}  asks {_fmt(actor.amounts())} each")
    lines.append("left free:")
    lines += [f"  {node}: {_fmt({k: v for k, v in left.items() if v > 0})}" for node, left in plan.free.items()]
    if any(t.resources.get("GPU", 0) > 0 for t in types) and learner.num_gpus == 0 and actor.num_gpus == 0:
        lines.append("note: the cluster has GPUs but this run config asks for none (see configs/cluster_h200.yaml)")
    return "\n".join(lines)


def _ranges(indices: list[int]) -> str:
    contiguous = len(indices) > 1 and indices[-1] - indices[0] == len(indices) - 1
    return f"{indices[0]}-{indices[-1]}" if contiguous else ",".join(map(str, indices))


def mounted_model_directories(prepared: dict[str, Any], config: RunConfig, source: str) -> list[str]:
    """Each model directory the run config names (a VLA's lerobot checkpoint, backbone, tokenizer) must reach every node
    through the YAML's file_mounts, from a source on this machine that holds it: lines saying where each comes from,
    or ConfigError naming the field."""
    mounts = {PurePosixPath(remote): local for remote, local in prepared.get("file_mounts", {}).items()}
    lines = []
    for field, path in paths_every_node_reads(config).items():
        if not field.startswith("policy."):
            continue
        under = [(remote, local) for remote, local in mounts.items() if PurePosixPath(path).is_relative_to(remote)]
        if not under:
            raise ConfigError(
                f"{field}={path!r} reaches no node of {source}: its file_mounts copy {sorted(map(str, mounts))}; "
                "put the directory under one of them (the VLA run configs use ~/flowrl-models)"
            )
        remote, local = max(under, key=lambda item: len(item[0].parts))
        copied = Path(local).expanduser() / PurePosixPath(path).relative_to(remote)
        if not copied.is_dir():
            raise ConfigError(
                f"{field}={path!r}: {source}'s file_mounts copy {remote} from {local} on this machine, which holds "
                f"no {copied.relative_to(Path(local).expanduser())}: put the directory there before `ray up`"
            )
        lines.append(f"  {field}: {path} <- {copied} (file_mounts)")
    return lines


def check_cluster(path: str | Path, config: RunConfig) -> str:
    """Every check on the cluster YAML at `path` against `config`; returns the placement printout or raises ConfigError."""
    source = str(path)
    prepared = ray_prepared(load_cluster_yaml(path), source)
    check_worker_counts(prepared, source)
    check_security(prepared, source)
    types = node_types(prepared, source)
    # Unset CPU requests are derived from the nodes the driver sees at start: the head and min_workers of each type
    # (every type at max_workers when min_workers are all 0).
    starting = {t.name: 1 if t.is_head else prepared["available_node_types"].get(t.name, {}).get("min_workers", 0) for t in types}
    node_cpus = [t.resources.get("CPU", 0) for t in types for _ in range(starting[t.name])]
    if not any(node_cpus):
        node_cpus = [t.resources.get("CPU", 0) for t in types for _ in range(t.count)]
    learner, actor = learner_request(config, sum(node_cpus)), actor_request(config, node_cpus)
    plan = plan_placement(
        types,
        learner,
        actor,
        config.actors.num_actors,
        source,
        even_split_cpus=config.actors.num_cpus is None,
        num_learners=config.learner.num_learners,
    )
    models = mounted_model_directories(prepared, config, source)
    printout = describe(source, prepared["provider"]["type"], types, learner, actor, plan)
    return "\n".join([printout, "model directories on every node:", *models]) if models else printout
