"""Cluster YAMLs through Ray's checks and the project's, the planned placement, and addresses refused before any Ray
starts (a multi-node run: tests/e2e/test_cluster.py)."""

from __future__ import annotations

import copy
import re
import socket
import subprocess
from pathlib import Path

import pytest
import ray
import yaml

from common.config import ConfigError, RunConfig
from common.config_loading import load_config
from learner.main import main
from learner.runtime.cluster_yaml import NodeType, check_cluster, plan_placement
from learner.runtime.ray_runtime import ResourceRequest, actor_request
from tests.conftest import REPO

CLUSTER_YAMLS = sorted((REPO / "cluster").glob("*.yaml"))
GPU_RUN = REPO / "configs" / "cluster_h200.yaml"


def test_cluster_directory_holds_the_shipped_configs() -> None:
    assert {p.name for p in CLUSTER_YAMLS} >= {"h200.yaml", "local.yaml"}


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
@pytest.mark.parametrize("run_config", ["default", "gpu"])
def test_every_cluster_yaml_passes_ray_and_project_checks(path: Path, run_config: str) -> None:
    config = RunConfig() if run_config == "default" else load_config(GPU_RUN)
    printout = check_cluster(path, config)
    learner_line = next(line for line in printout.splitlines() if line.strip().startswith("learner"))
    assert "head#" not in learner_line  # the head declares no room for work: the learner goes to a worker
    if run_config == "gpu":
        assert "GPU: 1" in learner_line and "learner_slot: 1" in learner_line
        assert "actors 0-9" in printout and "rollout_gpu: 0.1" in printout


def _h200() -> dict:
    return yaml.safe_load((REPO / "cluster" / "h200.yaml").read_text())


def _local() -> dict:
    return yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())


def _worker(data: dict) -> dict:
    return data["available_node_types"]["gpu_worker"]


def _set(data: dict, func) -> dict:
    data = copy.deepcopy(data)
    func(data)
    return data


def _rename_instance_type(d: dict) -> None:
    node_config = _worker(d)["node_config"]
    node_config["InstanceTyp"] = node_config.pop("InstanceType")


def _replace_in(key: str, old: str, new: str):
    return lambda d: d.update({key: [c.replace(old, new) for c in d[key]]})


OPEN_8000_9000 = [{"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
NO_CPU_FLAG = ["RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379"]

BROKEN = {
    "typo in node_config": (_set(_h200(), _rename_instance_type),
                            r"gpu_worker\.node_config\.InstanceTyp is not a field EC2 knows: did you mean InstanceType"),
    "typo in a disk field": (_set(_h200(), lambda d: _worker(d)["node_config"]["BlockDeviceMappings"][0]["Ebs"].update(VolumeSiz=100)),
                             r"BlockDeviceMappings\[0\]\.Ebs\.VolumeSiz is not a field EC2 knows: did you mean VolumeSize"),
    "negative min_workers": (_set(_h200(), lambda d: _worker(d).update(min_workers=-1)),
                             r"gpu_worker\.min_workers/max_workers must be >= 0"),
    "min above max": (_set(_h200(), lambda d: _worker(d).update(min_workers=2, max_workers=1)),
                      r"gpu_worker\.min_workers \(2\) must not exceed max_workers \(1\)"),
    "more GPUs than the instance has": (_set(_h200(), lambda d: _worker(d)["resources"].update(GPU=16)),
                                        r"gpu_worker\.resources\.GPU=16 but p5en\.48xlarge has 8"),
    "GPU worker without explicit resources": (_set(_h200(), lambda d: _worker(d).update(resources={"rollout_gpu": 7})),
                                              r"gpu_worker\.resources must declare CPU and GPU"),
    "slices that do not fit": (_set(_h200(), lambda d: _worker(d)["resources"].update(rollout_gpu=0)),
                               r"actors\.resources\.rollout_gpu: no node type .* declares 'rollout_gpu'"),
    "dashboard opened": (_set(_h200(), _replace_in("head_start_ray_commands", "127.0.0.1", "0.0.0.0")),
                         r"binds the dashboard to 0\.0\.0\.0"),
    "dashboard port in the security group": (_set(_h200(), lambda d: d["provider"]["security_group"].update(IpPermissions=OPEN_8000_9000)),
                                             r"IpPermissions\[0\] opens 8265 \(dashboard\), 8080 \(metrics export\) to the internet"),
    "token auth off": (_set(_h200(), _replace_in("worker_start_ray_commands", "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled")),
                       r"worker_start_ray_commands must start Ray with RAY_AUTH_MODE=token"),
    "unknown top-level field (Ray's schema)": (_set(_h200(), lambda d: d.update(max_worker=3)),
                                               r"Ray's schema rejects top level.*max_worker"),
    "head type not among node types (Ray)": (_set(_h200(), lambda d: d.update(head_node_type="headd")),
                                             r"Ray rejects it: .*head_node_type"),
    "local worker without --num-cpus": (_set(_local(), lambda d: d.update(worker_start_ray_commands=NO_CPU_FLAG)),
                                        r"worker_start_ray_commands must pass --num-cpus"),
    "local without worker_ips (Ray)": (_set(_local(), lambda d: d["provider"].pop("worker_ips")), r"Ray rejects it: .*worker_ips"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_cluster_yaml_gets_a_clear_error(tmp_path: Path, name: str) -> None:
    data, message = BROKEN[name]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        check_cluster(path, load_config(GPU_RUN))


def test_too_many_slices_for_the_node_types_names_the_actor_that_does_not_fit(tmp_path: Path) -> None:
    # 2 GPU workers x rollout_gpu 7 = 140 slices of 0.1: actor 140 is the first that cannot be placed.
    with pytest.raises(ConfigError, match=r"rollout actor 140 \(of 141\) does not fit.*rollout_gpu"):
        check_cluster(REPO / "cluster" / "h200.yaml", load_config(GPU_RUN, ["actors.num_actors=141", "actors.num_cpus=1"]))
    check_cluster(REPO / "cluster" / "h200.yaml", load_config(GPU_RUN, ["actors.num_actors=140", "actors.num_cpus=1"]))


@pytest.mark.parametrize("slice_size", [0.1, 0.25, 0.3, 1 / 3])
def test_first_fit_places_as_many_slices_as_a_hand_count_allows(slice_size: float) -> None:
    node = NodeType("gpu", "x", {"CPU": 1000, "GPU": 8, "rollout_gpu": 7}, 1, False)
    actor = ResourceRequest(1, slice_size, {"rollout_gpu": slice_size})
    learner = ResourceRequest(1, 1, {})
    capacity = 0  # independent count: add slices while the running sum stays within 7 (in Ray's 1e-4 units)
    while round((capacity + 1) * round(slice_size * 10_000)) <= 70_000:
        capacity += 1
    plan = plan_placement([node], learner, actor, capacity, "test")
    assert plan.actors == ["gpu#0"] * capacity
    with pytest.raises(ConfigError, match="does not fit"):
        plan_placement([node], learner, actor, capacity + 1, "test")


@pytest.mark.parametrize("node_cpus", [[2], [6, 6], [0, 4, 4], [1, 1, 1], [3, 5]])
@pytest.mark.parametrize("num_actors", [1, 2, 3, 10])
def test_unset_actor_cpus_are_the_largest_split_that_fits_every_actor_whole(node_cpus: list[float], num_actors: int) -> None:
    config = load_config(None, [f"actors.num_actors={num_actors}"])
    learner_units = round(min(0.5, sum(node_cpus) / 4) * 10_000)
    free = [max(0, c * 10_000 - learner_units) for c in node_cpus]
    fitting = [u for u in range(1, max(free) + 1) if sum(f // u for f in free) >= num_actors]  # brute force over Ray's units
    expected = max(fitting, default=1) / 10_000
    assert actor_request(config, node_cpus).num_cpus == pytest.approx(expected, abs=1e-12)
    if len(node_cpus) == 1:  # one machine: (CPUs - learner) / actors
        assert expected == pytest.approx((node_cpus[0] - min(0.5, node_cpus[0] / 4)) / num_actors, abs=1e-4)


def test_check_cluster_flag_prints_the_plan_and_starts_no_ray(capsys) -> None:
    assert main(["--check-cluster", str(REPO / "cluster" / "h200.yaml"), "--config", str(GPU_RUN), "--num-actors", "10"]) == 0
    out = capsys.readouterr().out
    assert "learner           -> gpu_worker#0" in out and "actors 0-9" in out
    assert not ray.is_initialized()
    assert main(["--check-cluster", str(REPO / "cluster" / "h200.yaml"), "--set", "actors.resources={rollout_gpuu: 0.1}"]) == 2
    assert "actors.resources.rollout_gpuu: no node type" in capsys.readouterr().err


UNREADABLE = {
    "bad syntax": ("provider:\n  type: aws\n  region: [us-east-1\n", r"is not valid YAML: .* at line 4, column 1"),
    "a tab": ("provider:\n\ttype: aws\n", r"is not valid YAML: found character '\\t' that cannot start any token at line 2, column 1"),
    "not UTF-8": (b"cluster_name: \xc3(\n", r"is not valid YAML: .*invalid continuation byte"),
    "a list": ("- provider\n- head_node_type\n", r"must hold a mapping at top level .*, got a list"),
    "a scalar": ("h200\n", r"must hold a mapping at top level .*, got a str"),
    "empty": ("", r"must hold a mapping at top level .*, got nothing"),
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_a_cluster_yaml_that_is_not_a_yaml_mapping_gets_one_line_naming_the_file(tmp_path: Path, capsys, name: str) -> None:
    text, message = UNREADABLE[name]
    path = tmp_path / "cluster.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["--check-cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(f"^cluster config error: cluster config {re.escape(str(path))} {message}", err), err
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"] and not ray.is_initialized()


def unused_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free once closed: nothing listens there


@pytest.mark.parametrize(
    ("argv", "environment", "message"),
    [(["--address", "127.0.0.1:{port}"], {}, r"--address 127\.0\.0\.1:{port}: no Ray cluster answers at \S+:{port} \(Connection refused"),
     ([], {"RAY_ADDRESS": "127.0.0.1:{port}"}, r"RAY_ADDRESS 127\.0\.0\.1:{port}: no Ray cluster answers"),
     (["--address", "ray://127.0.0.1:{port}"], {}, r"--address ray://127\.0\.0\.1:{port}: no Ray cluster answers at 127\.0\.0\.1:{port}"),
     (["--address", "head-node"], {}, r"--address head-node: Invalid address format: head-node; expected HOST:PORT")],
    ids=["flag", "environment", "ray-client", "no-port"],
)  # fmt: skip
def test_an_address_where_no_ray_answers_is_refused_at_once_and_nothing_written(tmp_path: Path, monkeypatch, capsys, argv, environment,
                                                                                 message) -> None:  # fmt: skip
    """ray.init would retry an absent GCS for minutes; the run refuses it before starting anything."""
    ray.shutdown()
    port = unused_loopback_port()
    for name, value in environment.items():
        monkeypatch.setenv(name, value.format(port=port))
    assert main([*(a.format(port=port) for a in argv), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search("^error: " + message.format(port=port), err), err
    assert not ray.is_initialized() and list(tmp_path.iterdir()) == []


def test_an_address_whose_port_takes_connections_but_is_not_ray_is_refused_within_the_deadline(tmp_path: Path, monkeypatch,
                                                                                                capsys) -> None:  # fmt: skip
    """A port that accepts TCP and never speaks Ray's protocol (another service, a stale forward): ray.init would wait on
    it with no deadline; the run refuses it after the probe's own."""
    from learner.runtime import ray_runtime

    ray.shutdown()
    monkeypatch.setattr(ray_runtime, "GCS_PROBE_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("0.0.0.0", 0))  # every interface: Ray dials a loopback address at this machine's own
        silent.listen(4)
        port = silent.getsockname()[1]
        assert main(["--address", f"127.0.0.1:{port}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    refusal = rf"^error: --address 127\.0\.0\.1:{port}: \S+:{port} takes connections but answers no Ray handshake within 1s"
    assert re.search(refusal, err), err
    assert not ray.is_initialized() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [("actors.resources={rollout_gpu: 1.5}", r"actors\.resources\.rollout_gpu must be >= 0 and, above 1, a whole number"),
     ("learner.resources={GPU: 1}", r"learner\.resources must not name \['GPU'\]: use learner\.num_cpus / learner\.num_gpus"),
     ("learner.resources=[1]", r"learner\.resources must be a mapping"),
     ("actors.resources={rollout_gpu: lots}", r"actors\.resources\.rollout_gpu must be float"),
     ("learner.num_gpus=2.5", r"learner\.num_gpus must be >= 0 and, above 1, a whole number")],
)  # fmt: skip
def test_resource_fields_are_validated_by_name(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


VLA_JOBS = ("smolvla", "pi0", "pi05")


@pytest.mark.parametrize("job", VLA_JOBS)
def test_each_vla_job_passes_the_cluster_check_with_its_model_directories_on_every_node(job, tmp_path, monkeypatch, capsys) -> None:
    """A VLA recipe with its cluster file after it (layered): the learner on a whole H200, the 16 actors on rollout
    slices of the same node, and each model directory the config names reaching every node through file_mounts
    from where this machine holds it (here a home of the test's own)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config_files = [str(REPO / "configs" / f"{job}_pick.yaml"), str(REPO / "configs" / f"cluster_{job}.yaml")]
    config = load_config(config_files)
    section = getattr(config.policy, config.policy.vla_section())
    models = [section.lerobot_checkpoint, section.vlm_path if job == "smolvla" else section.tokenizer_path]
    for model in models:
        (tmp_path / Path(model).relative_to("~")).mkdir(parents=True)
    argv = ["--check-cluster", str(REPO / "cluster" / "h200.yaml"), *(arg for file in config_files for arg in ("--config", file))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    slice_of_a_gpu = {"smolvla": 0.125, "pi0": 0.25, "pi05": 0.25}[job]
    assert "learner           -> gpu_worker#0  asks {CPU: 8, GPU: 1, learner_slot: 1}" in out
    assert f"actors 0-15       -> gpu_worker#0  asks {{CPU: 4, GPU: {slice_of_a_gpu:g}, rollout_gpu: {slice_of_a_gpu:g}}} each" in out
    for model in models:
        assert f": {model} <- {tmp_path / Path(model).relative_to('~')} (file_mounts)" in out

    # Refused: a directory this machine does not hold, and one that no file_mounts entry copies.
    (tmp_path / Path(models[0]).relative_to("~")).rmdir()
    assert main(argv) == 2
    assert f"file_mounts copy ~/flowrl-models from ~/flowrl-models on this machine, which holds no {Path(models[0]).name}" in (
        capsys.readouterr().err)  # fmt: skip
    assert main([*argv, "--set", f"policy.{config.policy.vla_section()}.lerobot_checkpoint=/mnt/models/base"]) == 2
    assert "lerobot_checkpoint='/mnt/models/base' reaches no node of" in capsys.readouterr().err


def test_config_files_are_layered_section_by_section_and_a_mapping_field_is_replaced_whole(tmp_path) -> None:
    recipe, site = tmp_path / "recipe.yaml", tmp_path / "site.yaml"
    recipe.write_text("actors:\n  num_actors: 6\n  resources: {a: 1}\nlearner:\n  num_cpus: 2\n")
    site.write_text("actors:\n  resources: {b: 2}\n")
    layered = load_config([recipe, site])
    assert (layered.actors.num_actors, layered.actors.resources, layered.learner.num_cpus) == (6, {"b": 2.0}, 2.0)
    assert load_config([site, recipe]).actors.resources == {"a": 1.0}  # the later file wins
    assert load_config(recipe) == load_config([recipe])


def test_the_learner_group_cluster_file_places_one_rank_on_each_gpu_node(tmp_path, monkeypatch, capsys) -> None:
    """configs/cluster_smolvla_learner_group.yaml over the SmolVLA recipe and its cluster file: each learner rank takes a
    node's learner_slot, so the two ranks land on the two GPU nodes; a third finds no slot and is refused naming it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config_files = [
        str(REPO / "configs" / name) for name in ("smolvla_pick.yaml", "cluster_smolvla.yaml", "cluster_smolvla_learner_group.yaml")
    ]
    smolvla = load_config(config_files).policy.smolvla
    for model in (smolvla.lerobot_checkpoint, smolvla.vlm_path):
        (tmp_path / Path(model).relative_to("~")).mkdir(parents=True)
    argv = ["--check-cluster", str(REPO / "cluster" / "h200.yaml"), *(arg for file in config_files for arg in ("--config", file))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"learner rank {rank}    -> gpu_worker#{rank}  asks {{CPU: 8, GPU: 1, learner_slot: 1}}" in out
    assert main([*argv, "--set", "learner.num_learners=3"]) == 2
    assert "learner rank 2 (of 3) does not fit" in capsys.readouterr().err


UBUNTU_SETUP_TRIAL = REPO / "cluster" / "try_setup_on_ubuntu.sh"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{existing}"], r"^error: .*/existing exists: name a new directory"),
        (["--bogus"], r"^error: unknown option --bogus"),
        (["--ca-file", "{missing}"], r"^error: --ca-file .*/missing\.crt: no such readable file$"),
        (["--keyring"], r"^error: --keyring needs a value"),
        (["{missing}", "{missing}"], r"^error: one ROOT directory only"),
    ],
    ids=["existing-root", "unknown-option", "missing-ca-file", "keyring-without-value", "two-roots"],
)
def test_the_ubuntu_setup_trial_refuses_bad_arguments_in_one_line_and_writes_nothing(tmp_path: Path, arguments, message) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "kept.txt").write_text("kept")
    paths = {"existing": str(existing), "missing": str(tmp_path / "missing.crt")}
    completed = subprocess.run(
        ["bash", str(UBUNTU_SETUP_TRIAL), *(a.format(**paths) for a in arguments)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert len(completed.stderr.splitlines()) == 1 and re.search(message, completed.stderr), completed.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["existing", "kept.txt"]
    assert (existing / "kept.txt").read_text() == "kept"


def test_the_ubuntu_setup_trial_reads_the_setup_commands_ray_up_runs() -> None:
    """The trial and CI's Python 3.12 stage read the YAML's setup commands with one shell function, which gives the list
    YAML itself gives."""
    setup = yaml.safe_load((REPO / "cluster" / "h200.yaml").read_text())["setup_commands"]
    for script in (UBUNTU_SETUP_TRIAL, REPO / ".ci" / "python312"):
        assert "source cluster/setup_helpers.sh" in script.read_text() and "mapfile -t setup < <(h200_setup_commands)" in script.read_text()
    listed = subprocess.run(
        ["bash", "-c", "source cluster/setup_helpers.sh && h200_setup_commands"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert listed.stdout.splitlines() == setup
    assert any(command.startswith("sudo apt-get ") for command in setup)
