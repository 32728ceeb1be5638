"""The tiny SmolVLA on a LIBERO task, end to end on the tests' local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest

from common.lerobot_dataset import lerobot_dataset_class, write_demonstrations
from learner.diagnose import main as diagnose
from learner.main import main
from tests.conftest import REPO, tiny_config, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")

OBJECT_0 = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"
OBJECT_1 = "pick_up_the_cream_cheese_and_place_it_in_the_basket"


def test_behaviour_cloning_from_a_lerobot_dataset_then_an_iteration_of_the_tiny_smolvla_in_lerobots_libero_layout(tmp_path):
    """The scripted expert's demonstration written as a LeRobotDataset in lerobot's LIBERO layout (both 32 px cameras
    under lerobot's keys, the 8-element state, the 7-element action, the task's sentence) and read back by lerobot's
    own dataset class; then learner.main with two actors, behaviour cloning from that dataset and one RL iteration whose
    learner updates with the ratio exactly 1 before its first step; the held-out episode is evaluated and filmed."""
    run_dir, dataset_dir = tmp_path / "run", tmp_path / "dataset"
    fields = {"env.suite": "libero", "env.task": OBJECT_0, "env.observations": "lerobot", "env.max_episode_steps": 8,
              "env.demo_benchmark_seed": 1, "env.eval_benchmark_seeds": "[0]", "policy.obs_dim": 8, "policy.action_dim": 7,
              "policy.cameras": "[image, image2]", "policy.smolvla.max_state_dim": 8, "policy.smolvla.max_action_dim": 7,
              "pretrain.train_steps": 3, "pretrain.batch_size": 4, "actors.envs_per_actor": 1,
              "actors.decisions_per_rollout": 3, "algorithm.minibatch_size": 3, "algorithm.update_epochs": 1, "iterations": 1,
              "eval_episodes": 1, "eval_videos": 1}  # fmt: skip
    config_file = REPO / "configs" / "smolvla_tiny_pick.yaml"
    written = write_demonstrations(tiny_config(tmp_path, config_file, **fields), dataset_dir, episodes=1)
    assert written["features"] == ["action", "observation.images.image", "observation.images.image2", "observation.state"]
    dataset = lerobot_dataset_class()("flowrl/libero", root=dataset_dir)
    assert (dataset.meta.fps, dataset.meta.robot_type, dataset.num_episodes, dataset.num_frames) == (30, "panda", 1, 8)
    row = dataset[2]  # lerobot's own reading: channels first, in [0, 1]
    assert row["observation.images.image"].shape == row["observation.images.image2"].shape == (3, 32, 32)
    assert row["observation.state"].shape == (8,) and row["action"].shape == (7,)
    assert row["task"] == "pick up the alphabet soup and place it in the basket" and row["observation.images.image"].std() > 0.02

    argv = tiny_run(run_dir, None, config_file=config_file, **fields, **{"pretrain.dataset": str(dataset_dir)})
    assert main(argv) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1]
    assert rows[0]["ppo/first_minibatch_ratio_dev"] <= 1e-5 and rows[0]["logprob/behaviour_gap_max"] < 1e-5
    assert all(row["rollout/env_steps"] > 0 and np.isfinite(row["losses/pg_loss"]) for row in rows)
    assert rows[-1]["eval/episodes"] == 1
    config = json.loads((run_dir / "run_config.json").read_text())
    assert (config["env"]["observations"], config["policy"]["cameras"]) == ("lerobot", ["image", "image2"])
    pretrain = json.loads((Path(json.loads((run_dir / "summary.json").read_text())["init_checkpoint"]) / "pretrain.json").read_text())
    assert (pretrain["demos"], pretrain["demo_success_rate"]) == (1, None)  # the dataset's episode
    assert pretrain["frames"].startswith("2 camera(s) ['image', 'image2'], 32x32")
    assert pretrain["instruction"] == "pick up the alphabet soup and place it in the basket"
    assert (run_dir / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
    (video,) = (run_dir / "videos" / "iter_000001").glob("*.mp4")  # filmed from the agentview camera
    with av.open(str(video)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) > 1 and frames[0].std() > 10


def test_behaviour_cloning_then_an_iteration_of_the_mlp_on_two_libero_tasks_from_the_objects_state(tmp_path, capsys):
    """configs/libero_object.yaml on two of its tasks at test size: the MLP on the project's LIBERO state (lerobot's 8
    elements, the goal's object and target, the task one-hot), behaviour cloning from scripted demonstrations, then an
    RL iteration, evaluated on LIBERO's own initial states; the run's diagnosis (learner.diagnose) scores its start and
    end on those states as the run's own evaluations did, task by task."""
    run_dir = tmp_path / "run"
    fields = {"env.task": f"{OBJECT_0},{OBJECT_1}", "env.max_episode_steps": 8, "policy.obs_dim": 26 + 2, "pretrain.num_demos": 1,
              "actors.decisions_per_rollout": 4, "eval_episodes": 1, "iterations": 1}  # fmt: skip
    assert main(tiny_run(run_dir, None, config_file=REPO / "configs" / "libero_object.yaml", **fields)) == 0

    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5 and np.isfinite(row["losses/pg_loss"])
    assert row["eval/episodes"] == 2 and {f"eval/task/{task}/success_rate" for task in (OBJECT_0, OBJECT_1)} <= set(row)
    summary = json.loads((run_dir / "summary.json").read_text())
    pretrain = json.loads((Path(summary["init_checkpoint"]) / "pretrain.json").read_text())
    assert pretrain["demos_per_task"] == {OBJECT_0: 1, OBJECT_1: 1} and pretrain["config"]["policy"]["obs_dim"] == 28
    assert pretrain["eval_layouts"].startswith(f"{OBJECT_0},{OBJECT_1} benchmark seeds [0]")

    assert diagnose([str(run_dir), "--seed", "3"]) == 0
    report = json.loads((run_dir / "diagnosis.json").read_text())
    for task in (OBJECT_0, OBJECT_1):
        for end, evaluation in (("start", summary["initial_eval"]), ("end", row)):
            cells = report[end]["cells"][task]
            assert all(cell["episodes"] == 1 for cell in cells.values())
            assert cells["held-out/deterministic"]["success"] == evaluation[f"eval/task/{task}/success_rate"]
    assert capsys.readouterr().out.count(f"| {OBJECT_0} |") == 1
