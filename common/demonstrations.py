"""Scripted demonstrations: a suite's expert run on given layouts, for behaviour cloning and its calibration."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from common.suites.base import ImageConfig, Layout, Suite
from common.validation import ConfigError


class FailedDemonstrationWarning(UserWarning):
    """Behaviour cloning is given scripted episodes that did not succeed: the clone learns the failures too."""


@dataclass
class Episode:
    observations: np.ndarray  # (T, obs_dim) float32, the state each action was chosen in.
    actions: np.ndarray  # (T, A) float32, the executed (noisy, clipped) actions.
    success: bool
    layout: Layout
    frames: np.ndarray | None = None  # (T, C, H, W, 3) uint8, the cameras' view of each state (with cameras only).


def collect_demonstrations(
    suite: Suite, task: str, layouts: Sequence[Layout], action_noise: float, seed: int, cameras: Sequence[ImageConfig] = ()
) -> list[Episode]:
    """One episode of the suite's scripted expert per layout (demonstration_episodes), all of them."""
    return list(demonstration_episodes(suite, task, layouts, action_noise, seed, cameras))


def successful_episodes(
    suite: Suite, task: str, layouts: Sequence[Layout], count: int, action_noise: float, seed: int, cameras: Sequence[ImageConfig] = ()
) -> Iterator[Episode]:
    """The first `count` episodes of the suite's scripted expert that succeed, trying `layouts` in order
    (demonstration_episodes), each as it ends; a ConfigError naming the task once the layouts run out first."""
    kept = tried = 0
    with closing(demonstration_episodes(suite, task, layouts, action_noise, seed, cameras)) as episodes:
        for episode in episodes:
            tried += 1
            if episode.success:
                kept += 1
                yield episode
            if kept == count:
                return
    raise ConfigError(
        f"the scripted expert of {task} succeeded on {kept} of the {tried} layouts it was given, fewer than the {count} "
        "successful demonstrations asked for: ask for fewer, or set pretrain.successful_demos_only: false"
    )


def demonstration_episodes(
    suite: Suite, task: str, layouts: Sequence[Layout], action_noise: float, seed: int, cameras: Sequence[ImageConfig] = ()
) -> Iterator[Episode]:
    """One episode of the suite's scripted expert per layout, each as it ends, with N(0, action_noise^2) added to every
    action; each episode ends at the first success or at env.max_episode_steps.

    The noise widens the state distribution beyond the expert's narrow tube; the stored actions are
    the executed ones, so every (observation, action) pair is consistent with the dynamics.
    With `cameras`, every state's frames are rendered too (rendering never changes the simulation).
    Deterministic in its arguments.
    """
    if action_noise < 0:
        raise ValueError(f"action_noise must be >= 0, got {action_noise}")
    expert = suite.expert(task)
    if expert is None:
        raise ValueError(f"{suite.name} has no scripted expert for {task}: behaviour cloning needs demonstrations")
    env = type(suite)(dataclasses.replace(suite.config, stop_on_success=True)).make_env(task, cameras, layouts[0])
    rng = np.random.default_rng(seed)
    try:
        for episode_index, layout in enumerate(layouts):
            # Gymnasium convention: seed the first reset only; later resets continue its generator.
            obs, _ = env.reset(seed=seed if episode_index == 0 else None, options={"layout": layout})
            observations, actions, frames = [], [], []
            done = success = False
            while not done:
                noise = rng.normal(0.0, action_noise, size=env.action_space.shape)
                # The expert reads the task's whole state, not what the policy observes (a multi-task one-hot, lerobot's 4 elements)
                action = np.clip(expert.act(env.privileged_state()) + noise, -1.0, 1.0).astype(np.float32)
                observations.append(obs)
                actions.append(action)
                if cameras:
                    frames.append(env.render_cameras())
                obs, _, terminated, truncated, info = env.step(action)
                success = info["success"]
                done = terminated or truncated
            yield Episode(np.stack(observations), np.stack(actions), success, layout, np.stack(frames) if cameras else None)
    finally:
        env.close()
