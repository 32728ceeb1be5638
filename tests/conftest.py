"""Test-wide settings: headless MuJoCo rendering must be chosen before mujoco is first imported."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402

from common.config import RunConfig  # noqa: E402
from common.config_loading import load_config  # noqa: E402


def tiny_config(tmp_path, **sections) -> RunConfig:
    """A run config small enough for tests: few demos, short training, short rollouts."""
    overrides = [
        "pretrain.num_demos=2", "pretrain.train_steps=60", "pretrain.eval_episodes=0",
        "policy.hidden_dim=64", "policy.num_layers=2",
        "actors.num_actors=2", "actors.envs_per_actor=2", "actors.decisions_per_rollout=8",
        "env.max_episode_steps=40", "algorithm.minibatch_size=16", "algorithm.update_epochs=2",
        "iterations=2", "eval_every=0", "eval_episodes=4", "checkpoint_every=1", "algorithm.critic_warmup_iters=0", "eval_videos=0",
        f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    overrides += [f"{k}={v}" for k, v in sections.items()]
    return load_config(None, overrides)


@pytest.fixture(scope="session")
def bc_checkpoint(tmp_path_factory):
    """A small behaviour-cloned checkpoint, built once per test session."""
    from learner.pretrain import pretrain

    out = tmp_path_factory.mktemp("bc") / "checkpoint"
    pretrain(tiny_config(tmp_path_factory.mktemp("cfg")), out, progress=False)
    return out
