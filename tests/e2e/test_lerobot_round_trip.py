"""The lerobot round trip at test size, with lerobot's own commands (behind the project's torchvision guard on the
Python 3.11 line, learner.lerobot_tools): the scripted expert's LeRobotDataset in lerobot's Metaworld layout, a tiny
SmolVLA trained on it by lerobot-train, fine-tuned by learner.main from that checkpoint as it is, exported, and scored
by lerobot-eval on lerobot's own Metaworld env beside the project's evaluation (learner.parity). The figures of the
full-size round trip are docs/lerobot.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.config_loading import load_config
from common.lerobot_dataset import write_demonstrations
from common.policy.smolvla.stand_ins import TinyVLMSpec, tiny_vlm_dir
from learner.export import main as export
from learner.main import main
from learner.parity import main as parity
from tests.conftest import REPO, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")  # learner.main runs on the tests' Ray, as the other end-to-end runs

SIDE = 32  # the dataset's frames and the tiny backbone's input; lerobot-eval's env draws 480 pixels, which SmolVLA resizes


def lerobot(command: str, *arguments: str, timeout: float) -> subprocess.CompletedProcess:
    """One of lerobot's commands, offline, as a user runs it (through learner.lerobot_tools)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "learner.lerobot_tools", command, *arguments], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_lerobot_train_starts_a_run_whose_export_lerobot_eval_scores_on_its_own_env(tmp_path):
    dataset = tmp_path / "dataset"
    recorded = load_config(REPO / "configs" / "smolvla_tiny_lerobot_pick.yaml", [f"policy.image_size={SIDE}", "env.max_episode_steps=60"])
    assert write_demonstrations(recorded, dataset, episodes=2)["episodes"] == 2

    vlm = tiny_vlm_dir(TinyVLMSpec(image_size=SIDE))
    lerobot("train", "--policy.type=smolvla", f"--policy.vlm_model_name={vlm}", "--policy.load_vlm_weights=false",
            "--policy.num_vlm_layers=2", "--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.num_steps=4",
            f"--policy.resize_imgs_with_padding=[{SIDE},{SIDE}]",
            "--policy.freeze_vision_encoder=false", "--policy.train_expert_only=false", "--policy.push_to_hub=false", "--policy.device=cpu",
            "--dataset.repo_id=flowrl/metaworld", f"--dataset.root={dataset}", f"--output_dir={tmp_path / 'train'}", "--steps=2",
            "--batch_size=4", "--num_workers=0", "--save_freq=2", "--wandb.enable=false", timeout=300)  # fmt: skip
    trained = tmp_path / "train" / "checkpoints" / "last" / "pretrained_model"
    features = json.loads((trained / "config.json").read_text())["input_features"]
    assert sorted(features) == ["observation.image", "observation.state"]

    run_dir = tmp_path / "run"
    assert main(tiny_run(run_dir, trained, "--no-dashboard", config_file=REPO / "configs" / "smolvla_tiny_lerobot_pick.yaml",
                         **{"actors.envs_per_actor": 1, "actors.decisions_per_rollout": 4, "algorithm.minibatch_size": 4,
                            "eval_episodes": 2})) == 0  # fmt: skip
    recorded_config = json.loads((run_dir / "run_config.json").read_text())
    assert recorded_config["env"]["observations"] == "lerobot" and recorded_config["policy"]["image_keys"] == ["observation.image"]

    out = tmp_path / "export"
    assert export([str(run_dir), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["input_features"] == features  # lerobot's layout, as it came in
    # scored by both evaluators, as a user asks it of their own checkpoint: lerobot-eval on lerobot's env, beside the
    # project's held-out evaluation with lerobot's semantics
    parity_dir = tmp_path / "parity"
    assert parity([str(out), "--config", str(REPO / "configs" / "smolvla_tiny_lerobot_pick.yaml"), "--episodes", "1", "--seed", "0",
                   "--out", str(parity_dir)]) == 0  # fmt: skip
    scored = json.loads((parity_dir / "lerobot_eval" / "eval_info.json").read_text())["overall"]
    assert scored["n_episodes"] == 1 and 0.0 <= scored["pc_success"] <= 100.0
    both = json.loads((parity_dir / "parity.json").read_text())
    assert both["lerobot_eval"]["episodes"] == both["project"]["episodes"] == 1
    assert both["lerobot_eval"]["success"] == scored["pc_success"] / 100
    low, high = both["project"]["ci95"]
    assert both["agree"] == (low <= both["lerobot_eval"]["ci95"][1] and both["lerobot_eval"]["ci95"][0] <= high)
