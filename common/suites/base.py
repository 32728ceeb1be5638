"""What an environment suite offers the loop, and what the loop asks of each of its envs.

A suite (Metaworld, a gymnasium env id, ...) is one module in common/suites with one line in its registry
(common/suites/__init__.py). The loop, pre-training, evaluation and filming reach a suite only through `Suite`
and the envs it builds (`SuiteEnv`), so nothing outside the suite's own module names its tasks, cameras, state
layout or episode limit.

Initial states. A `Layout` names one reproducible initial state of a task: a seed fixes `layouts_per_seed` of them
and the index picks one. The env config's demonstration, training and held-out seeds are disjoint (EnvConfig.validate), so
the three sets of initial states never overlap, and an episode is a deterministic function of its layout (and the
policy's actions), whatever the env's reset seed. How a suite realises a layout is its own: Metaworld's benchmark
goals, a gymnasium reset seed.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
import numpy as np

from common.config import ConfigError, EnvConfig, PolicyConfig


@dataclass(frozen=True)
class Layout:
    task: str  # The suite's task.
    benchmark_seed: int  # The seed that fixes a set of the task's initial states (Metaworld: `metaworld.MT1`'s seed).
    index: int  # Which of that seed's initial states (0 .. layouts_per_seed - 1).


@dataclass(frozen=True)
class ImageConfig:
    """One camera of a policy's input: the suite's camera name, rendered at width x height. Names are checked
    against the scene when an env is built. `fast`: drawn without shadows, reflections and multisampling, which cost
    about ten times the frame on a CPU rasteriser; False: with the renderer's defaults, as lerobot's env classes draw
    (env.render)."""

    width: int = 64
    height: int = 64
    camera: str = "corner"
    fast: bool = True

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
      `info["success"]` a bool; "success" rewards pay 1.0 on the step where success first holds; with env.reward
      "shaped" (a suite that offers_shaping) the reward is the same and `info["shaping_potential"]` is the suite's measure of
      progress toward success, in [0, 1], which the chunked stepping turns into shaping (common.vector_env);
    - `render_cameras()` renders the cameras the env was built with, on demand: (C, H, W, 3) uint8, right way up;
    - an env built with `film` keeps that camera's view after every step of the current episode in `frames`.
    """

    task: str  # the suite's name of the task
    instruction: str  # the task in words, for language-conditioned policies
    frames: list[np.ndarray]

    def privileged_state(self) -> np.ndarray:
        """The task's whole simulator state as its scripted expert reads it (Metaworld's 39 elements, float32), whatever
        the policy observes (env.observations)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state for a scripted expert")

    def reset_layout(self, options: dict[str, Any] | None) -> Layout | None:
        """The layout reset's options ask for (None: the current one); a ValueError for an unknown option or a layout
        of another task."""
        options = dict(options or {})
        layout = options.pop("layout", None)
        if options:
            raise ValueError(f"unknown reset options {sorted(options)}; supported: ['layout']")
        if layout is not None:
            self.check_layout(layout)
        return layout

    def check_layout(self, layout: Layout) -> None:
        """A ValueError for a layout of another task than this env's."""
        if layout.task != self.task:
            raise ValueError(f"a layout of {layout.task} given to an env of {self.task}")

    # The run's episode rules (env.reward, env.stop_on_success, env.max_episode_steps) and the episode's progress, which
    # every suite's env keeps under these names; _checked_action and _episode_rules apply them alike.
    _reward_mode: str
    _stop_on_success: bool
    _max_episode_steps: int
    _episode_steps: int
    _succeeded: bool
    _needs_reset: bool

    def _checked_action(self, action: np.ndarray, dtype: type) -> np.ndarray:
        """A step's action, clipped to [-1, 1] in `dtype`; a RuntimeError when no episode runs, a ValueError for a
        wrong shape."""
        if self._needs_reset:
            raise RuntimeError("call reset() before step(): the episode has ended, has not started, or its layout changed")
        action = np.clip(np.asarray(action, dtype=dtype), -1.0, 1.0)
        if action.shape != self.action_space.shape:
            raise ValueError(f"action must have shape {self.action_space.shape}, got {action.shape}")
        return action

    def _episode_rules(self, success: bool, env_reward: float, env_ended: bool = False, env_cut: bool = False) -> tuple[float, bool, bool]:
        """One more step of the episode, that reported `success`: its (reward, terminated, truncated). "success" rewards
        ("shaped" ones too) pay 1.0 on the step where success first holds, "dense" ones are the env's own; the episode ends on success
        with env.stop_on_success, when the env itself ends (env_ended) or cuts it (env_cut), and after
        env.max_episode_steps steps."""
        self._episode_steps += 1
        first_success = success and not self._succeeded
        self._succeeded |= success
        reward = float(env_reward) if self._reward_mode == "dense" else float(first_success)
        terminated = env_ended or (success and self._stop_on_success)
        truncated = env_cut or self._episode_steps >= self._max_episode_steps
        self._needs_reset = terminated or truncated
        return reward, terminated, truncated

    _cameras: list  # what each suite renders its cameras with, one per ImageConfig it was built with
    _layout: Layout  # the layout the next reset starts (set_layout, reset's option)

    @property
    def num_cameras(self) -> int:
        return len(self._cameras)

    @property
    def layout(self) -> Layout:
        return self._layout

    def render_cameras(self) -> np.ndarray:
        """The current scene from every camera the env was built with: (C, H, W, 3) uint8, right way up."""
        if not self._cameras:
            raise RuntimeError("render_cameras() needs cameras: build the env with cameras=[ImageConfig(...)]")
        return self._render_cameras()

    @abstractmethod
    def _render_cameras(self) -> np.ndarray:
        """render_cameras() of an env that has cameras."""


class Expert(Protocol):
    """A scripted policy for one task: a state vector in, an action in [-1, 1]^A out."""

    def act(self, state: np.ndarray) -> np.ndarray: ...


class TaskIndicator(SuiteEnv):
    """A suite env whose state ends in a one-hot of its task among the run's tasks: how a state policy (the MLP) tells
    the tasks of a multi-task run apart. Everything but the state is the wrapped env's."""

    def __init__(self, env: SuiteEnv, position: int, count: int) -> None:
        self.env, self.task, self.instruction = env, env.task, env.instruction
        self.indicator = np.zeros(count, dtype=np.float32)
        self.indicator[position] = 1.0
        low, high = env.observation_space.low, env.observation_space.high
        self.observation_space = gymnasium.spaces.Box(
            np.concatenate([low, np.zeros(count, np.float32)]), np.concatenate([high, np.ones(count, np.float32)]), dtype=np.float32
        )
        self.action_space = env.action_space

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        state, info = self.env.reset(seed=seed, options=options)
        return np.concatenate([state, self.indicator]), info

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        state, *rest = self.env.step(action)
        return np.concatenate([state, self.indicator]), *rest

    def privileged_state(self) -> np.ndarray:
        return self.env.privileged_state()

    @property
    def num_cameras(self) -> int:
        return self.env.num_cameras

    def render_cameras(self) -> np.ndarray:
        return self.env.render_cameras()

    @property
    def layout(self) -> Layout:
        return self.env.layout

    def set_layout(self, layout: Layout) -> None:
        self.env.set_layout(layout)

    @property
    def frames(self) -> list[np.ndarray]:
        return self.env.frames

    def close(self) -> None:
        self.env.close()


class Suite(ABC):
    """A family of tasks the loop can train on, built from the run's env section (`make_suite`)."""

    name: str  # its key in the registry
    layouts_per_seed: int  # initial states per seed
    film_camera: str  # the camera held-out episodes are filmed from (learner.replay, eval videos)
    # Whether the suite's envs report a shaping potential (info["shaping_potential"]): env.reward "shaped" is refused
    # for a suite without one.
    offers_shaping: bool = False

    def __init__(self, config: EnvConfig) -> None:
        self.config = config
        self._tasks: list[str] | None = None  # tasks() once resolved

    task_sets: dict[str, tuple[str, ...]] = {}  # named sets of tasks (Metaworld's MT10, MT50)

    # What lerobot's own env class of the suite gives a policy (env.observations "lerobot"): each frame's observation key
    # -> the scene camera drawn for it, and the state's width. A suite lerobot has no env class for keeps them empty.
    lerobot_images: dict[str, str] = {}
    lerobot_state_size: int = 0
    lerobot_frame_size: int = 0  # the side of its square frames
    lerobot_fps: int = 0  # the frame rate its datasets are recorded at (lerobot's env config's fps)
    lerobot_robot: str = ""  # the robot type its datasets name

    def lerobot_episode_limit(self, task: str) -> int:
        """The episode limit lerobot's env class of the suite sets for `task` (env.observations "lerobot" takes it as
        env.max_episode_steps unless that is given)."""
        return self.episode_limit(task)

    def image_sources(self, task: str) -> dict[str, str]:
        """The frames the run's observations offer a policy: each one's observation key -> the scene camera drawn for
        it. "project": every camera of the task as observation.images.<camera>; "lerobot": lerobot's env's own."""
        if self.config.lerobot_observations:
            return dict(self.lerobot_images)
        return {f"observation.images.{camera}": camera for camera in self.cameras(task)}

    @abstractmethod
    def instruction(self, task: str) -> str:
        """The task in words; a ValueError naming the known tasks when `task` is not one."""

    @abstractmethod
    def build_env(self, task: str, cameras: Sequence[ImageConfig], layout: Layout, film: ImageConfig | None) -> SuiteEnv:
        """The suite's own env of `task` (make_env's arguments)."""

    @abstractmethod
    def episode_limit(self, task: str) -> int:
        """The most steps an episode of `task` can have: env.max_episode_steps may not exceed it."""

    # The sizes and cameras of a suite whose tasks all share them; a suite whose tasks differ overrides sizes() and
    # cameras() instead.
    state_size: int
    action_size: int
    camera_names: tuple[str, ...]

    def sizes(self, task: str) -> tuple[int, int]:
        """(state elements, action elements) of `task`'s own envs, as the run's observations give the state."""
        self.instruction(task)  # refuses an unknown task
        return (self.lerobot_state_size if self.config.lerobot_observations else self.state_size), self.action_size

    def action_bounds(self, task: str) -> list[float]:
        """The env units the policy's [-1, 1] actions map onto for `task` (policy.action_bounds: lows, then highs), or []
        where the env acts in [-1, 1] itself."""
        return []

    def cameras(self, task: str) -> list[str]:
        """The camera names `task`'s envs can render (what policy.cameras may list)."""
        self.instruction(task)
        return list(self.camera_names)

    def expert(self, task: str) -> Expert | None:
        """The task's scripted expert for behaviour cloning, or None when the suite has none."""
        return None

    def tasks(self) -> list[str]:
        """The run's tasks, from env.task: one task, a named set (task_sets), or tasks separated by commas. A
        ValueError names an unknown or repeated one. Resolved once: every env the suite builds asks for them."""
        if self._tasks is None:
            names = list(self.task_sets.get(self.config.task, [name.strip() for name in self.config.task.split(",")]))
            for name in names:
                self.instruction(name)
            if len(set(names)) != len(names):
                raise ValueError(f"{self.config.task!r} names a task twice")
            self._tasks = names
        return list(self._tasks)

    def make_env(
        self, task: str, cameras: Sequence[ImageConfig] = (), layout: Layout | None = None, film: ImageConfig | None = None
    ) -> SuiteEnv:
        """An env of `task` under the run's episode rules (config), rendering `cameras` on demand as env.render says,
        starting from `layout` (default: the first training layout); with `film`, it keeps that camera's view of every
        step. In a multi-task run its state ends in the task's one-hot (TaskIndicator), but for lerobot's observations,
        which tell tasks apart by their sentences alone."""
        cameras = [dataclasses.replace(camera, fast=self.config.fast_render) for camera in cameras]
        env = self.build_env(task, cameras, layout or Layout(task, self.config.train_benchmark_seeds[0], 0), film)
        tasks = self.tasks()
        return env if len(tasks) == 1 or self.config.lerobot_observations else TaskIndicator(env, tasks.index(task), len(tasks))

    def task_indicator(self) -> bool:
        """The run's states end in a one-hot of the task (several tasks, the project's observations)."""
        return len(self.tasks()) > 1 and not self.config.lerobot_observations

    def state_dim(self) -> int:
        """The state a policy of the run reads: its tasks' own, and the task one-hot when there are several."""
        tasks = self.tasks()
        widths = {self.sizes(task)[0] for task in tasks}
        if len(widths) != 1:
            raise ValueError(f"the tasks of {self.config.task!r} have states of different sizes {sorted(widths)}")
        return widths.pop() + (len(tasks) if self.task_indicator() else 0)

    def task_state_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The task's state bounds (low, high), when the suite knows finite ones; None: it does not."""
        return None

    def state_bounds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The bounds of the state a policy of the run reads (the task one-hot's [0, 1] included), when every task has
        finite ones: a randomly initialised policy normalises to them (FlowPolicy.set_state_bounds)."""
        tasks = self.tasks()
        bounds = [self.task_state_bounds(task) for task in tasks]
        if any(bound is None for bound in bounds):
            return None
        low, high = np.min([low for low, _ in bounds], axis=0), np.max([high for _, high in bounds], axis=0)
        if self.task_indicator():
            low, high = np.concatenate([low, np.zeros(len(tasks))]), np.concatenate([high, np.ones(len(tasks))])
        return low, high

    def layouts(self, task: str, benchmark_seeds: Sequence[int]) -> list[Layout]:
        """All layouts of `task` for each seed, seed-major (nothing is simulated here)."""
        self.instruction(task)  # refuses an unknown task
        return [Layout(task, seed, index) for seed in benchmark_seeds for index in range(self.layouts_per_seed)]

    def held_out(self, episodes: int) -> list[Layout]:
        """The first `episodes` held-out layouts (env.eval_benchmark_seeds) of each of the run's tasks, task by task."""
        return [layout for task in self.tasks() for layout in self.layouts(task, self.config.eval_benchmark_seeds)[:episodes]]

    def check(self, policy: PolicyConfig) -> None:
        """A ConfigError naming the field when the run's env section or the policy's input and output sizes do not
        fit this suite; called before any work starts."""
        try:
            tasks = self.tasks()
            state_dim = self.state_dim()
        except ValueError as exc:
            raise ConfigError(f"env.task: {exc}") from None
        if self.config.reward == "shaped" and not self.offers_shaping:
            raise ConfigError(
                f"env.reward 'shaped' needs a suite whose envs report a shaping potential; {self.name} has none: use 'success' or 'dense'"
            )
        for task in tasks:
            limit = self.episode_limit(task)
            if self.config.max_episode_steps > limit:
                raise ConfigError(
                    f"env.max_episode_steps ({self.config.max_episode_steps}) exceeds {self.name}'s episode limit "
                    f"for {task} ({limit}): the env would end episodes there anyway"
                )
        for task in tasks:
            unmapped = sorted(set(policy.rename_map) - set(self.image_sources(task)))
            if unmapped:
                given = ", ".join(f"{key} ({camera})" for key, camera in self.image_sources(task).items()) or "no frames"
                raise ConfigError(
                    f"policy.rename_map maps {unmapped}, which env.observations {self.config.observations!r} of "
                    f"{self.name} task {task} does not give (it gives {given}): map keys it gives"
                )
        if policy.image_size > 0:
            for task in tasks:
                unknown = [camera for camera in policy.cameras if camera not in self.cameras(task)]
                if unknown:
                    raise ConfigError(f"policy.cameras {unknown} are not cameras of {self.name} task {task}: it has {self.cameras(task)}")
            self.check_image_keys(policy, tasks[0])
        bounds = self.action_bounds(tasks[0])
        if policy.action_bounds and [float(value) for value in policy.action_bounds] != bounds:
            raise ConfigError(
                f"policy.action_bounds {policy.action_bounds} are not the env units {self.name} task {tasks[0]} maps "
                f"[-1, 1] onto ({bounds or '[]: it acts in [-1, 1]'}): leave policy.action_bounds unset"
            )
        what = f"{self.name} task {tasks[0]}" if len(tasks) == 1 else f"the {len(tasks)} tasks of {self.config.task} (with their one-hot)"
        for name, value, expected, kind in (
            ("obs_dim", policy.obs_dim, state_dim, "state"),
            ("action_dim", policy.action_dim, self.sizes(tasks[0])[1], "action"),
        ):
            if value != expected:
                raise ConfigError(f"policy.{name}={value} but the {kind} of {what} has {expected} elements: set policy.{name}={expected}")

    def check_image_keys(self, policy: PolicyConfig, task: str) -> None:
        """A ConfigError unless each of the policy's frames (policy.image_features(), after policy.rename_map) is one the
        run's observations give, from the camera policy.cameras names for it."""
        sources = self.image_sources(task)
        env_key = {policy.rename_map.get(key, key): key for key in sources}  # the key a policy reads -> the env's
        for camera, key in zip(policy.cameras, policy.image_features()):
            if sources.get(env_key.get(key, "")) != camera:
                given = ", ".join(f"{key} ({camera})" for key, camera in sources.items())
                raise ConfigError(
                    f"policy reads {key} from camera {camera}, which env.observations {self.config.observations!r} of "
                    f"{self.name} does not give (it gives {given}): map an env key to it with policy.rename_map"
                )

    # The layouts some suites compute before they can build an env (Metaworld simulates 50 resets per seed): built
    # once by the run's start-up, handed to the rollout actors, and read back from a cache file by later processes.
    # Suites whose layouts cost nothing keep these defaults.

    def layout_tables(self, task_seeds: Sequence[tuple[str, int]]) -> dict[Any, Any]:
        """The tables of these (task, seed) pairs, built here, to hand to other processes (adopt_layout_tables)."""
        return {}

    def held_layout_tables(self, task_seeds: Sequence[tuple[str, int]]) -> tuple[dict[Any, Any], list[tuple[str, int]]]:
        """The tables of these (task, seed) pairs this process holds or reads from its cache, and the pairs still to
        build (none is built here)."""
        return {}, []

    def adopt_layout_tables(self, tables: dict[Any, Any]) -> None:  # noqa: B027 (a suite without tables adopts none)
        """Use tables another process built."""
