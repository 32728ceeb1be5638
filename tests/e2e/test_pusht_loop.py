"""PushT through the generic gymnasium suite, end to end: `learner.main` on configs/pusht.yaml with a local Ray."""

from __future__ import annotations

import json
import math

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from learner.main import main
from tests.conftest import REPO, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")

PUSHT_CONFIG = REPO / "configs" / "pusht.yaml"


def test_one_iteration_on_pusht_trains_evaluates_and_films(tmp_path) -> None:
    """Two actors step PushT (5-d state, 2-d action scaled from [-1, 1] onto its pixel bounds), the learner updates
    with the ratio exactly 1 before its first step, and the held-out evaluation is filmed by PushT's own renderer."""
    run_dir = tmp_path / "run"
    fields = {
        "actors.decisions_per_rollout": 6,
        "env.max_episode_steps": 20,
        "algorithm.minibatch_size": 12,
        "algorithm.update_epochs": 1,
        "iterations": 1,
        "eval_every": 1,
        "eval_episodes": 2,
        "eval_videos": 1,
        "policy.hidden_dim": 32,
        "policy.num_layers": 1,
    }
    assert main(tiny_run(run_dir, None, config_file=PUSHT_CONFIG, **fields)) == 0

    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5 and row["logprob/behaviour_gap_max"] < 1e-5
    assert row["rollout/env_steps"] > 0 and row["eval/episodes"] == 2 and np.isfinite(row["losses/pg_loss"])
    config = json.loads((run_dir / "run_config.json").read_text())
    assert (config["env"]["suite"], config["env"]["task"]) == ("gym", "gym_pusht/PushT-v0")
    assert (run_dir / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
    # No demonstration set the state's statistics: the random init normalises PushT's pixel state over its bounds
    start = load_file(run_dir / "checkpoints" / "random_init" / "model.safetensors")
    high = torch.tensor([512.0, 512.0, 512.0, 512.0, 2 * math.pi])
    torch.testing.assert_close(start["obs_mean"], high / 2)
    torch.testing.assert_close(start["obs_std"], high / 2)
    (video,) = (run_dir / "videos" / "iter_000001").glob("*.mp4")
    assert video.name.startswith("gym_pusht-PushT-v0_1-00_")
    with av.open(str(video)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) > 1 and frames[0].std() > 0  # the board, not a blank frame
