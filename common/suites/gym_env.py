"""Any registered gymnasium env id as a suite (env.suite "gym"): env.task is the id, env.gym says how to build it and
how its observations and infos reach the loop.

- Layouts: a layout's reset seed is drawn from (benchmark seed, index) by numpy's SeedSequence, so the initial state
  is a deterministic function of the layout (for envs whose reset draws only from the seed it is given).
- Actions: the policy acts in [-1, 1]^A, mapped linearly onto the env's Box bounds.
- State: the observation when it is a Box, else the Box under env.gym.state_key of a Dict observation; flattened to
  float32.
- Success: info[env.gym.success_key] after each step.
- Camera: one, named env.gym.camera: the env's own render() (built with render_mode "rgb_array" only when a camera or
  a film is asked for), or the frame under that key of a Dict observation; area-averaged to each ImageConfig's size
  (resize_frame).
- lerobot's observations (env.observations "lerobot"), for the env ids lerobot has an env config of (LEROBOT_ENVS):
  the env built with lerobot's observation type, its state and frame under lerobot's keys, lerobot's sentence and
  episode limit. lerobot's policies act in the env's own units (policy.action_bounds, action_bounds()).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from common.config import ConfigError, EnvConfig, GymSuiteConfig
from common.suites.base import ImageConfig, Layout, Suite, SuiteEnv

# Initial states per benchmark seed, as Metaworld's, so that the default seeds' sets stay as many and as disjoint.
LAYOUTS_PER_SEED = 50

# The episode limit of env ids registered without max_episode_steps: env.max_episode_steps is then the only one.
NO_EPISODE_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class LerobotGymEnv:
    """What lerobot's env config of a gymnasium env id (lerobot.envs.configs) hands a policy: the keyword arguments
    that shape its observation, the Dict observation's state and frame under lerobot's keys, and the sentence, frame
    rate and episode limit it runs with."""

    kwargs: dict[str, Any]
    state_key: str
    state_size: int
    images: dict[str, str]  # lerobot's observation key -> the key of its frame in the env's Dict observation
    frame_size: int  # the side of the frame the env observes
    fps: int
    episode_limit: int
    instruction: str  # what lerobot-eval hands a policy as its task: "" for an env that describes none


# PushT (lerobot's PushtEnv, env.type=pusht): observation type pixels_agent_pos, the pusher's position as the state and
# the env's own observed frame at gym_pusht's default size (lerobot sets the size of render()'s view alone); gym_pusht
# describes no task, so lerobot-eval's sentence is empty.
LEROBOT_ENVS = {
    "gym_pusht/PushT-v0": LerobotGymEnv(
        kwargs={"obs_type": "pixels_agent_pos"},
        state_key="agent_pos",
        state_size=2,
        images={"observation.image": "pixels"},
        frame_size=96,
        fps=10,
        episode_limit=300,
        instruction="",
    ),
}


def layout_seed(layout: Layout) -> int:
    """The gymnasium reset seed of `layout`: one 32-bit word of the SeedSequence of (benchmark seed, index)."""
    if layout.benchmark_seed < 0 or not 0 <= layout.index < LAYOUTS_PER_SEED:
        raise ValueError(f"layout needs benchmark_seed >= 0 and index in [0, {LAYOUTS_PER_SEED}), got {layout}")
    return int(np.random.SeedSequence([layout.benchmark_seed, layout.index]).generate_state(1)[0])


def resize_frame(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """(H, W, 3) uint8 -> (height, width, 3) uint8 by area averaging: each output pixel is the mean of the input area
    its cell covers (a pixel partly covered counts by the part), rounded half to even. Exact: whole-number sums, then
    one division. Integer reductions are block means, integer enlargements repeat pixels, equal sizes copy."""
    if frame.shape[:2] == (height, width):
        return frame.copy()
    rows, columns = frame.shape[:2]
    sums = _cell_sums(_cell_sums(frame, height, axis=0, largest=255), width, axis=1, largest=255 * rows)
    return np.rint(sums / (rows * columns)).astype(np.uint8)


def _cell_sums(values: np.ndarray, cells: int, axis: int, largest: int) -> np.ndarray:
    """Whole-number `values` (at most `largest`) summed over `cells` equal cells along `axis`, in units that keep every
    overlap whole: a pixel is `cells` units long, a cell `pixels` units, and each pixel counts by the units of it the
    cell covers. Each cell touches at most ceil(pixels / cells) + 1 pixels: one small product per cell. Every partial
    sum is a whole number below 2^24 in float32, or else below 2^53 in float64, so none is rounded."""
    values = np.moveaxis(values, axis, 0)
    pixels = len(values)
    edges = np.arange(cells + 1) * pixels
    touched = edges[:-1, None] // cells + np.arange(-(-pixels // cells) + 1)  # (cells, taps) pixel indices
    units = np.minimum((touched + 1) * cells, edges[1:, None]) - np.maximum(touched * cells, edges[:-1, None])
    dtype = np.float32 if largest * pixels < 2**24 else np.float64
    gathered = values[np.minimum(touched, pixels - 1)].reshape(*touched.shape, -1).astype(dtype)  # past the end: 0 units
    sums = np.matmul(np.maximum(units, 0).astype(dtype)[:, None, :], gathered)
    return np.moveaxis(sums.reshape(cells, *values.shape[1:]), 0, axis)


def _words(task: str) -> str:
    """An env id in words: "gym_pusht/PushT-v0" -> "push T" (namespace and version dropped, camel case split)."""
    name = gymnasium.envs.registration.parse_env_id(task)[1]
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return " ".join(word if word.isupper() and len(word) == 1 else word.lower() for word in words) or name


class GymSuite(Suite):
    """Registered gymnasium env ids, built with env.gym's module and kwargs."""

    name = "gym"
    layouts_per_seed = LAYOUTS_PER_SEED

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        tasks = [name.strip() for name in config.task.split(",")]
        lerobot = LEROBOT_ENVS.get(tasks[0])
        if lerobot is not None and all(LEROBOT_ENVS.get(name) == lerobot for name in tasks):
            self.lerobot_images, self.lerobot_state_size = dict(lerobot.images), lerobot.state_size
            self.lerobot_frame_size, self.lerobot_fps = lerobot.frame_size, lerobot.fps
        self.gym: GymSuiteConfig = config.gym
        self._instruction: str | None = None  # the sentence when it is lerobot's, not env.gym's
        if config.lerobot_observations:
            missing = [name for name in tasks if name not in LEROBOT_ENVS]
            if missing or not self.lerobot_images:
                raise ConfigError(
                    f"env.observations 'lerobot' gives what lerobot's env config of an env id gives, and lerobot has "
                    f"one for {sorted(LEROBOT_ENVS)}, not for {missing or tasks} together: use env.observations "
                    "'project'"
                )
            # lerobot's observation type and keys over env.gym's: the rest of its keyword arguments stay
            (camera,) = set(lerobot.images.values())
            self.gym = dataclasses.replace(
                config.gym, kwargs={**config.gym.kwargs, **lerobot.kwargs}, state_key=lerobot.state_key, camera=camera
            )
            self._instruction = lerobot.instruction
        self.film_camera = self.gym.camera  # the env's one view
        if self.gym.module:
            try:
                importlib.import_module(self.gym.module)
            except ImportError as exc:
                raise ValueError(
                    f"env.gym.module {self.gym.module!r} cannot be imported ({exc}): install the package that "
                    f"registers env.task {config.task!r}"
                ) from None
        self._spaces: dict[str, tuple[spaces.Box, spaces.Box]] = {}  # task -> its state space and its env's action space

    def _spec(self, task: str) -> gymnasium.envs.registration.EnvSpec:
        if task not in gymnasium.registry:
            module = self.gym.module
            registered = sorted(
                env_id
                for env_id, spec in gymnasium.registry.items()
                if isinstance(spec.entry_point, str) and spec.entry_point.startswith(f"{module}.")
            )
            known = f"env.gym.module {module!r} registers {registered}" if module else "env.gym.module is empty"
            raise ValueError(f"{task!r} is not a registered gymnasium env id ({known}): is the module that registers it missing?")
        return gymnasium.spec(task)

    def instruction(self, task: str) -> str:
        self._spec(task)
        if self._instruction is not None:
            return self._instruction
        return self.gym.instruction or _words(task)

    def cameras(self, task: str) -> list[str]:
        self._spec(task)
        return [self.gym.camera]

    def lerobot_episode_limit(self, task: str) -> int:
        return LEROBOT_ENVS[task].episode_limit if task in LEROBOT_ENVS else self.episode_limit(task)

    def episode_limit(self, task: str) -> int:
        # gymnasium.make takes max_episode_steps among its keyword arguments, over the registered one.
        limit = self.gym.kwargs.get("max_episode_steps", self._spec(task).max_episode_steps)
        return NO_EPISODE_LIMIT if limit is None else int(limit)

    def sizes(self, task: str) -> tuple[int, int]:
        state, action = self._task_spaces(task)
        return state.shape[0], action.shape[0]

    def action_bounds(self, task: str) -> list[float]:
        _, action = self._task_spaces(task)
        return [float(value) for value in (*action.low.reshape(-1), *action.high.reshape(-1))]

    def task_state_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray] | None:
        state, _ = self._task_spaces(task)
        return (state.low, state.high) if np.isfinite(state.low).all() and np.isfinite(state.high).all() else None

    def _task_spaces(self, task: str) -> tuple[spaces.Box, spaces.Box]:
        if task not in self._spaces:
            env = self.build_env(task, (), Layout(task, self.config.train_benchmark_seeds[0], 0), None)
            self._spaces[task] = (env.observation_space, env.env_action_space)
            env.close()
        return self._spaces[task]

    def build_env(self, task: str, cameras: Sequence[ImageConfig], layout: Layout, film: ImageConfig | None) -> GymTaskEnv:
        return GymTaskEnv(task, self.instruction(task), self.config, self.gym, cameras, layout, film)


class GymTaskEnv(SuiteEnv):
    """One gymnasium env id as the loop steps it (SuiteEnv), under the run's episode rules.

    Rewards: "success" pays 1.0 on the step where success first holds; "dense" is the env's own reward. An episode
    ends on success when env.stop_on_success, when the env itself terminates or truncates it (an env may not be
    stepped past its own end), and after env.max_episode_steps steps.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        task: str,
        instruction: str,
        config: EnvConfig,
        gym: GymSuiteConfig,
        cameras: Sequence[ImageConfig],
        layout: Layout,
        film: ImageConfig | None,
    ) -> None:
        self.task, self.instruction = task, instruction
        self._gym = gym
        self._reward_mode, self._stop_on_success, self._max_episode_steps = config.reward, config.stop_on_success, config.max_episode_steps
        for camera in [*cameras, *([film] if film is not None else [])]:
            if camera.camera != self._gym.camera:
                raise ValueError(f"camera {camera.camera!r} is not one of {task}'s cameras: ['{self._gym.camera}'] (env.gym.camera)")
        self._cameras, self._film = list(cameras), film
        self._layout = layout
        layout_seed(layout)  # refuses a layout outside the suite's

        rendering = bool(cameras) or film is not None
        try:
            self._env = gymnasium.make(task, **self._gym.kwargs, **({"render_mode": "rgb_array"} if rendering else {}))
        except (TypeError, ValueError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            also = " with render_mode 'rgb_array' (for its camera)" if rendering else ""
            raise ValueError(f"env.gym.kwargs {self._gym.kwargs}{also} do not build {task}: {message}") from None
        observed = self._env.observation_space
        # The camera is a frame of the Dict observation (lerobot's PushT: pixels), or else the env's render()
        self._frame_key = self._gym.camera if isinstance(observed, spaces.Dict) and self._gym.camera in observed.spaces else None
        if rendering and self._frame_key is None and "rgb_array" not in self._env.metadata.get("render_modes", []):
            raise ValueError(
                f"{task} renders no rgb_array frames (its render modes: {self._env.metadata.get('render_modes', [])}), "
                f"so it has no camera {self._gym.camera!r}"
            )

        action_space = self._env.action_space
        if not isinstance(action_space, spaces.Box):
            raise ValueError(f"env.task {task}: its action space {action_space} is not a Box (the gym suite drives continuous actions)")
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"env.task {task}: its action space {action_space} is unbounded; [-1, 1] maps onto finite bounds only")
        self.env_action_space = action_space  # the units [-1, 1] maps onto
        self._action_low = action_space.low.astype(np.float64).reshape(-1)
        self._action_high = action_space.high.astype(np.float64).reshape(-1)
        self.action_space = spaces.Box(-1.0, 1.0, shape=self._action_low.shape, dtype=np.float32)
        state_space = self._state_space(self._env.observation_space)
        self.observation_space = spaces.Box(
            state_space.low.astype(np.float32).reshape(-1), state_space.high.astype(np.float32).reshape(-1), dtype=np.float32
        )

        self.frames: list[np.ndarray] = []
        self._view: np.ndarray | None = None  # the env's render() of the current state, once drawn, or its observed frame
        self._started = False
        self._episode_steps = 0
        self._succeeded = False
        self._needs_reset = True

    def _state_space(self, space: gymnasium.Space) -> spaces.Box:
        key = self._gym.state_key
        if isinstance(space, spaces.Dict):
            if not key:
                raise ValueError(
                    f"env.gym.state_key is empty but {self.task}'s observation is a Dict with keys {list(space.spaces)}: "
                    "set it to the state's key"
                )
            if key not in space.spaces:
                raise ValueError(f"env.gym.state_key {key!r} is not in {self.task}'s observation; its keys: {list(space.spaces)}")
            space = space[key]
        elif key:
            raise ValueError(
                f"env.gym.state_key {key!r} is set but {self.task}'s observation is a {type(space).__name__}, not a Dict: leave it empty"
            )
        if not isinstance(space, spaces.Box):
            raise ValueError(f"env.task {self.task}: its state observation is {space}, not a Box (env.gym.state_key {key!r})")
        return space

    def _render_cameras(self) -> np.ndarray:
        view = self._render()
        return np.stack([resize_frame(view, camera.width, camera.height) for camera in self._cameras])

    def _render(self) -> np.ndarray:
        if not self._started:
            raise RuntimeError("call reset() before rendering: there is no state to draw yet")
        if self._view is None:
            view = self._env.render()
            self._view = self._checked_frame(view, "render()")
        return self._view

    def _checked_frame(self, view: Any, source: str) -> np.ndarray:
        if not isinstance(view, np.ndarray) or view.ndim != 3 or view.shape[2] != 3 or view.dtype != np.uint8:
            raise ValueError(
                f"{self.task}'s {source} gave {type(view).__name__} {getattr(view, 'shape', '')}, not an (H, W, 3) uint8 frame"
            )
        return view

    def _observed(self, observation: Any) -> np.ndarray:
        """The state of `observation`, keeping its frame as the current view where the camera is one of its keys."""
        if self._frame_key is not None:
            self._view = self._checked_frame(np.asarray(observation[self._frame_key]).copy(), f"observation[{self._frame_key!r}]")
        return self._state(observation)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        # The seed only seeds `self.np_random` (gymnasium's contract); the env is reset with the layout's seed.
        super().reset(seed=seed)
        layout = self.reset_layout(options) or self._layout
        observation, _ = self._env.reset(seed=layout_seed(layout))
        self._layout, self._started, self._view = layout, True, None
        self._episode_steps, self._succeeded, self._needs_reset = 0, False, False
        self.frames = []
        return self._observed(observation), {"layout": self._layout}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        action = self._checked_action(action, np.float64)
        env_action = self._action_low + (action + 1.0) * 0.5 * (self._action_high - self._action_low)
        space = self._env.action_space
        observation, env_reward, env_terminated, env_truncated, info = self._env.step(env_action.astype(space.dtype).reshape(space.shape))
        self._view = None
        if self._gym.success_key not in info:
            raise ValueError(f"env.gym.success_key {self._gym.success_key!r} is not in {self.task}'s step info; its keys: {sorted(info)}")
        success = bool(info[self._gym.success_key])
        reward, terminated, truncated = self._episode_rules(success, env_reward, bool(env_terminated), bool(env_truncated))
        state = self._observed(observation)
        if self._film is not None:
            self.frames.append(resize_frame(self._render(), self._film.width, self._film.height))
        return state, reward, terminated, truncated, {**info, "success": success}

    def _state(self, observation: Any) -> np.ndarray:
        if self._gym.state_key:
            observation = observation[self._gym.state_key]
        return np.asarray(observation, dtype=np.float32).reshape(-1)

    def close(self) -> None:
        self._env.close()
