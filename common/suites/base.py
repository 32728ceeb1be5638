"""What an environment suite offers the loop, and what the loop asks of each of its envs.

A suite (Metaworld, a gymnasium env id, ...) is one module in common/suites with one line in its registry
(common/suites/__init__.py). The loop, pre-training, evaluation and filming reach a suite only through `Suite`
and the envs it builds (`SuiteEnv`), so nothing outside the suite's own module names its tasks, cameras, state
layout or episode limit.

Initial states. A `Layout` names one reproducible initial state: a seed fixes `layouts_per_seed` of them and the
index picks one. The env config's demonstration, training and held-out seeds are disjoint (EnvConfig.validate), so
the three sets of initial states never overlap, and an episode is a deterministic function of its layout (and the
policy's actions), whatever the env's reset seed. How a suite realises a layout is its own: Metaworld's benchmark
goals, a gymnasium reset seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
import numpy as np

from common.config import ConfigError, EnvConfig, PolicyConfig


@dataclass(frozen=True)
class Layout:
    benchmark_seed: int  # The seed that fixes a set of the suite's initial states (Metaworld: `metaworld.MT1`'s seed).
    index: int  # Which of that seed's initial states (0 .. layouts_per_seed - 1).


@dataclass(frozen=True)
class ImageConfig:
    """One camera of a policy's input: the suite's camera name, rendered at width x height. Names are checked
    against the scene when an env is built."""

    width: int = 64
    height: int = 64
    camera: str = "corner"

    def __post_init__(self) -> None:
        for name in ("width", "height"):
            value = getattr(self, name)
            # bool is an int subclass; True as a size is certainly a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ImageConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.camera, str) or not self.camera:
            raise ValueError(f"ImageConfig.camera must be a non-empty str, got {self.camera!r}")


class SuiteEnv(gymnasium.Env):
    """One task of a suite, as the loop steps it.

    - `reset(options={"layout": layout})` starts the episode `layout` names (without the option: the current layout)
      and returns the float32 state vector (observation_space.shape) and an info dict;
    - `step(action)` takes an action in [-1, 1]^A (action_space) and returns gymnasium's five values, with
      `info["success"]` a bool; "success" rewards pay 1.0 on the step where success first holds;
    - `render_cameras()` renders the cameras the env was built with, on demand: (C, H, W, 3) uint8, right way up;
    - an env built with `film` keeps that camera's view after every step of the current episode in `frames`.
    """

    task: str  # the suite's name of the task
    instruction: str  # the task in words, for language-conditioned policies
    frames: list[np.ndarray]

    @property
    @abstractmethod
    def num_cameras(self) -> int: ...

    @abstractmethod
    def render_cameras(self) -> np.ndarray: ...

    @property
    @abstractmethod
    def layout(self) -> Layout: ...


class Expert(Protocol):
    """A scripted policy for one task: a state vector in, an action in [-1, 1]^A out."""

    def act(self, state: np.ndarray) -> np.ndarray: ...


class Suite(ABC):
    """A family of tasks the loop can train on, built from the run's env section (`make_suite`)."""

    name: str  # its key in the registry
    layouts_per_seed: int  # initial states per seed
    film_camera: str  # the camera held-out episodes are filmed from (learner.replay, eval videos)

    def __init__(self, config: EnvConfig) -> None:
        self.config = config

    @abstractmethod
    def instruction(self, task: str) -> str:
        """The task in words; a ValueError naming the known tasks when `task` is not one."""

    @abstractmethod
    def make_env(self, task: str, cameras: Sequence[ImageConfig] = (), layout: Layout | None = None,
                 film: ImageConfig | None = None) -> SuiteEnv:  # fmt: skip
        """An env of `task` under the run's episode rules (config), rendering `cameras` on demand, starting from
        `layout` (default: the first training layout)."""

    @abstractmethod
    def episode_limit(self, task: str) -> int:
        """The most steps an episode of `task` can have: env.max_episode_steps may not exceed it."""

    def expert(self, task: str) -> Expert | None:
        """The task's scripted expert for behaviour cloning, or None when the suite has none."""
        return None

    def layouts(self, task: str, benchmark_seeds: Sequence[int]) -> list[Layout]:
        """All layouts of `task` for each seed, seed-major (nothing is simulated here)."""
        self.instruction(task)  # refuses an unknown task
        return [Layout(benchmark_seed=seed, index=index) for seed in benchmark_seeds for index in range(self.layouts_per_seed)]

    def check(self, policy: PolicyConfig) -> None:
        """A ConfigError naming the field when the run's env section or the policy's input and output sizes do not
        fit this suite; called before any work starts."""
        task = self.config.task
        try:
            self.instruction(task)
        except ValueError as exc:
            raise ConfigError(f"env.task: {exc}") from None
        limit = self.episode_limit(task)
        if self.config.max_episode_steps > limit:
            raise ConfigError(f"env.max_episode_steps ({self.config.max_episode_steps}) exceeds {self.name}'s episode limit for "
                              f"{task} ({limit}): the env would end episodes there anyway")  # fmt: skip
        state_dim, action_dim = self.sizes(task)
        for name, value, expected in (("obs_dim", policy.obs_dim, state_dim), ("action_dim", policy.action_dim, action_dim)):
            if value != expected:
                raise ConfigError(f"policy.{name}={value} but {self.name} task {task} has a {expected}-element "
                                  f"{'state' if name == 'obs_dim' else 'action'}: set policy.{name}={expected}")  # fmt: skip

    @abstractmethod
    def sizes(self, task: str) -> tuple[int, int]:
        """(state elements, action elements) of `task`'s envs."""

    # The layouts some suites compute before they can build an env (Metaworld simulates 50 resets per seed): built
    # once by the run's start-up, handed to the rollout actors, and read back from a cache file by later processes.
    # Suites whose layouts cost nothing keep these defaults.

    def layout_tables(self, task: str, benchmark_seeds: Sequence[int]) -> dict[Any, Any]:
        """The tables of these seeds, built here, to hand to other processes (adopt_layout_tables)."""
        return {}

    def held_layout_tables(self, task: str, benchmark_seeds: Sequence[int]) -> tuple[dict[Any, Any], list[int]]:
        """The tables of these seeds this process holds or reads from its cache, and the seeds still to build (none
        is built here)."""
        return {}, []

    def adopt_layout_tables(self, tables: dict[Any, Any]) -> None:  # noqa: B027 (a suite without tables adopts none)
        """Use tables another process built."""
