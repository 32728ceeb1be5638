"""Placement and Ray on real local clusters: a multi-node run placed by custom resources, bad input found while a run
starts its own Ray, and the priorities of a local Ray's workers. Each test starts the Ray it needs (no_ray)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from common.config_loading import load_config
from learner.main import main, run
from tests.conftest import REPO, tiny_config
from tests.helpers.vla import SMOLVLA_TINY_CONFIG, TINY_VLA_RUN

pytestmark = pytest.mark.usefixtures("no_ray")


def test_the_tiny_smolvla_runs_on_three_nodes_placed_by_the_vla_cluster_files_resources(tmp_path: Path, capsys) -> None:
    """Three Ray nodes on this machine shaped as cluster/h200.yaml's (a head that hosts no work, where the driver runs;
    workers declaring configs/cluster_smolvla.yaml's custom resources, learner_slot on the first, rollout_gpu on both;
    here without GPUs): the tiny SmolVLA's learner lands on the first worker and one rollout actor on each, frames and
    instruction tokens reach the learner, which updates with the ratio check, and the frozen VLM stays bit-identical.
    The learner's checkpoints reach the run directory on the driver's node through it (actors.run_files), and the
    actors read the starting weights from there."""
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from actors.run_files import FETCHED_DIR

    site = load_config([SMOLVLA_TINY_CONFIG, REPO / "configs" / "cluster_smolvla.yaml"])
    (learner_slot,), (rollout_gpu,) = site.learner.resources, site.actors.resources
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True})
    temp_dirs = [tmp_path / f"worker{i}_tmp" for i in range(2)]  # each worker's own: where it keeps what it fetched
    workers = []
    for i, temp_dir in enumerate(temp_dirs):
        temp_dir.mkdir()
        resources = {rollout_gpu: 1, **({learner_slot: 1} if i == 0 else {})}
        workers.append(cluster.add_node(num_cpus=1, resources=resources, env_vars={"TMPDIR": str(temp_dir)}))
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path, SMOLVLA_TINY_CONFIG, **{**TINY_VLA_RUN, "iterations": 2, "allow_random_init": True,
                         "learner.num_cpus": 0.5, "learner.resources": f"{{{learner_slot}: 1}}", "actors.num_cpus": 0.5,
                         "actors.resources": f"{{{rollout_gpu}: 1}}"})  # fmt: skip
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        run(config, address=cluster.address)
        ours = ("LearnerActor", "RolloutActor")
        placed = {(a.class_name, a.node_id) for a in list_actors(detail=True, limit=1000) if a.class_name in ours}
        intended = {("LearnerActor", workers[0].node_id)} | {("RolloutActor", w.node_id) for w in workers}
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert placed == intended
    assert "[start] the learner runs on another node than this driver" in capsys.readouterr().out
    # The actor on the second worker read the starting weights, which the learner sent to the driver's node, from there.
    assert [path.name for path in (temp_dirs[1] / FETCHED_DIR).glob("*/*")] == ["random_init"]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2]
    assert rows[0]["ppo/first_minibatch_ratio_dev"] <= 1e-5 and rows[0]["logprob/behaviour_gap_max"] < 1e-4
    assert rows[0]["rollout/env_steps"] == 2 * 4 * 4  # 2 actors x 1 env x 4 decisions of a 4-action chunk
    # At the default actors.policy_lag=1 iterations 1 and 2 both sample with v0 on every actor (iteration 2 while
    # iteration 1 trains): each actor loaded the version its calls named.
    for row, lag in zip(rows, (0, 1)):
        assert [row[f"actor/{i}/weight_version"] for i in range(2)] == [0, 0]
        assert [row[f"actor/{i}/weight_version_lag"] for i in range(2)] == [lag, lag]
        assert [row[f"actor/{i}/alive"] for i in range(2)] == [1, 1]
    before = load_file(str(run_dir / "checkpoints" / "random_init" / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "iter_000002" / "model.safetensors"))
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert any(k.startswith("vla.model.action_out_proj") for k in changed) and any(k.startswith("critic_head") for k in changed)
    assert not any(".vlm." in k or k.startswith("vla.model.state_proj") for k in changed)  # the frozen VLM is bit-identical


def test_bad_input_found_while_ray_starts_shuts_that_ray_down_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    """learner.main.run starts Ray while preflight checks the input in a thread: a bad checkpoint still ends the run
    with its named error and nothing written, and the Ray that run started is shut down again."""
    import learner.main as main_module

    started = []
    real_connect = main_module.connect_ray
    monkeypatch.setattr(main_module, "connect_ray", lambda *args: started.append(real_connect(*args)) or started[-1])
    argv = [
        "--checkpoint",
        str(tmp_path / "missing"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-dashboard",
        "--num-actors",
        "1",
    ]
    assert main(argv) == 2
    assert started == [True]  # this run started the Ray it had to shut down
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
    assert "has no model.safetensors" in capsys.readouterr().err


def test_a_local_rays_learner_keeps_the_drivers_priority_and_its_rollout_actors_take_a_lower_one(tmp_path, bc_checkpoint) -> None:
    """The learner's update runs while the actors sample (policy_lag 1) and is the iteration's critical path: a local
    Ray starts its workers at the driver's niceness (not Ray's 15), the learner stays there, and every rollout actor
    lowers its own priority to ACTOR_NICENESS."""
    import os

    from learner.runtime.ray_runtime import start_local_ray
    from learner.runtime.startup import ACTOR_NICENESS, plan_resources, start_actors, start_learner

    def niceness(_actor) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    config = tiny_config(tmp_path, init_checkpoint=str(bc_checkpoint))
    assert not ray.is_initialized()
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.get(ray.remote(niceness).remote(None)) == niceness(None)  # any worker, before it changes its own
        learner_request, actor_request = plan_resources(config)
        learner = start_learner(config, bc_checkpoint, None, learner_request)
        pool = start_actors(config, str(bc_checkpoint), actor_request)
        assert ray.get(learner.actors[0].__ray_call__.remote(niceness)) == niceness(None) < ACTOR_NICENESS
        assert ray.get([actor.__ray_call__.remote(niceness) for actor in pool.actors.values()]) == [ACTOR_NICENESS] * 2
    finally:
        ray.shutdown()


def test_a_directory_the_config_names_missing_on_one_node_is_refused_naming_the_node(tmp_path: Path) -> None:
    """Two Ray nodes whose `~` differ (each node's own home, as on two machines): a backbone directory under the head's
    home only is refused in one line naming the other node and the field, before any actor could start there; once
    that node holds it too, the check passes."""
    from ray.cluster_utils import Cluster

    from common.config import ConfigError
    from learner.files.node_files import check_every_node_holds, paths_every_node_reads

    homes = {name: tmp_path / name for name in ("head_home", "worker_home")}
    (homes["head_home"] / "models" / "backbone").mkdir(parents=True)
    token = {"RAY_AUTH_TOKEN_PATH": str(Path.home() / ".ray" / "auth_token")}  # where this process's Ray keeps it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "env_vars": {"HOME": str(homes["head_home"]), **token}})
    worker = cluster.add_node(num_cpus=1, env_vars={"HOME": str(homes["worker_home"]), **token})
    config = tiny_config(tmp_path, REPO / "configs" / "smolvla_tiny_pick.yaml", **{"policy.smolvla.vlm_path": "~/models/backbone"})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        with pytest.raises(ConfigError) as refused:
            check_every_node_holds(paths_every_node_reads(config))
        (homes["worker_home"] / "models" / "backbone").mkdir(parents=True)
        check_every_node_holds(paths_every_node_reads(config))
    finally:
        ray.shutdown()
        cluster.shutdown()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"node {worker.address.split(':')[0]} (Ray node {worker.node_id[:8]}) has no '~/models/backbone' (policy.smolvla.vlm_path): "
    ), message


def test_a_node_without_the_run_files_reads_and_writes_them_through_the_drivers_node(tmp_path: Path) -> None:
    """actors.run_files on two Ray nodes: the driver on a head that hosts no work, a task on the worker. There the
    run's files are elsewhere: a checkpoint is read through a copy fetched into the worker's temporary directory (the
    same files, kept by content: a second read takes the same copy), and a directory written there arrives in the
    driver's run directory whole, checksums listed. On the head they are read in place."""
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.run_files import FETCHED_DIR, RunFiles
    from common.storage import directory_contents, write_directory_atomically

    start, written = tmp_path / "start", tmp_path / "run" / "checkpoints" / "iter_000001"
    write_directory_atomically(start, lambda directory: (directory / "model.safetensors").write_bytes(b"weights"))

    def use(files: RunFiles) -> tuple[bool, list[str], dict[str, bytes]]:
        copies = []
        for _ in range(2):
            with files.local_copy(start) as copy:
                copies.append(str(copy))
                read = {name: data.tobytes() for name, data in directory_contents(copy).items()}
        files.write(written, lambda path: write_directory_atomically(path, lambda tmp: (tmp / "a.txt").write_text("new")))
        return files.here(), copies, read

    worker_tmp = tmp_path / "worker_tmp"
    worker_tmp.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    head, worker = cluster.head_node.node_id, cluster.add_node(num_cpus=1, env_vars={"TMPDIR": str(worker_tmp)}).node_id
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        files = RunFiles.of_this_node()
        on_worker = ray.get(ray.remote(use).options(num_cpus=1).remote(files))
        pinned_to_head = NodeAffinitySchedulingStrategy(head, soft=False)
        on_head = ray.get(ray.remote(use).options(num_cpus=0, scheduling_strategy=pinned_to_head).remote(files))
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert files.node_id == head != worker
    here, copies, read = on_worker
    assert not here and copies[0] == copies[1] and Path(copies[0]).is_relative_to(worker_tmp / FETCHED_DIR)
    assert read == {name: data.tobytes() for name, data in directory_contents(start).items()}
    assert on_head == (True, [str(start)] * 2, read)
    assert (written / "a.txt").read_text() == "new" and json.loads((written / "checksums.json").read_text()).keys() == {"a.txt"}
