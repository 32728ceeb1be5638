"""The tiny SmolVLA on a LIBERO task, end to end on the tests' local Ray."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest

from learner.main import main
from tests.conftest import REPO, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")

SPATIAL_0 = "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"


def test_an_iteration_of_the_tiny_smolvla_on_a_libero_task(tmp_path):
    """learner.main with two actors: the tiny SmolVLA reads both 32 px cameras, the 8-d state and the task's
    instruction, acts in 7-d, the learner updates with the ratio exactly 1 before its first step, and the held-out
    episode is evaluated and filmed. LIBERO has no demonstrations offline, so the policy starts from random weights."""
    run_dir = tmp_path / "run"
    fields = {"env.suite": "libero", "env.task": SPATIAL_0, "env.max_episode_steps": 8, "policy.obs_dim": 8, "policy.action_dim": 7,
              "policy.cameras": "[agentview, wrist]", "policy.smolvla.max_state_dim": 8, "policy.smolvla.max_action_dim": 7,
              "actors.envs_per_actor": 1, "actors.decisions_per_rollout": 3, "algorithm.minibatch_size": 3, "algorithm.update_epochs": 1,
              "iterations": 1, "eval_episodes": 1, "eval_videos": 1}  # fmt: skip
    argv = tiny_run(run_dir, None, "--allow-random-init", config_file=REPO / "configs" / "smolvla_tiny_pick.yaml", **fields)
    assert main(argv) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1]
    assert rows[0]["ppo/first_minibatch_ratio_dev"] <= 1e-5 and rows[0]["logprob/behaviour_gap_max"] < 1e-5
    assert all(row["rollout/env_steps"] > 0 and np.isfinite(row["losses/pg_loss"]) for row in rows)
    assert rows[-1]["eval/episodes"] == 1
    config = json.loads((run_dir / "run_config.json").read_text())
    assert (config["env"]["suite"], config["env"]["task"], config["policy"]["cameras"]) == ("libero", SPATIAL_0, ["agentview", "wrist"])
    assert (run_dir / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
    (video,) = (run_dir / "videos" / "iter_000001").glob("*.mp4")  # filmed from the agentview camera
    with av.open(str(video)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) > 1 and frames[0].std() > 10
