"""Metaworld as a suite: its tasks as SuiteEnvs with settable layouts, its benchmark layouts, its scripted experts.

A Metaworld "layout" is one of the 50 object/goal configurations that `metaworld.MT1` draws for a task from its
benchmark seed: Layout(benchmark_seed, index). The simulation is deterministic given the layout, whatever the
reset seed.
"""

from __future__ import annotations

import os
import types

# MuJoCo picks its OpenGL backend when it is first imported, so this must precede the metaworld
# import. EGL gives headless rendering (Mesa llvmpipe on CPU-only machines); a caller's choice wins.
os.environ.setdefault("MUJOCO_GL", "egl")

import copy
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import metaworld
import mujoco
import numpy as np
from gymnasium import spaces
from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
from metaworld.policies import ENV_POLICY_MAP

from common.config import ConfigError, EnvConfig, cache_dir
from common.storage import CheckpointWriteError, write_file_atomically
from common.suites.base import ImageConfig, Layout, Suite, SuiteEnv

GymObservation = np.ndarray | dict[str, np.ndarray]


@dataclass(frozen=True)
class TaskSpec:
    name: str  # Metaworld environment name, e.g. "pick-place-v3".
    instruction: str  # Language instruction given to language-conditioned policies.
    # Metaworld's reset calls reset_model() twice, the first time before mj_resetData. For most tasks that first call
    # only costs time (half of every reset); for some (drawer and window tasks) the second call reads model state the
    # first one set, so skipping it changes the initial state. True: skip it (MetaworldTaskEnv._reset_simulation);
    # tests/integration/test_envs.py checks that every task's reset and later steps are still Metaworld's own, bit for bit.
    reset_model_once: bool = False
    # Every reset_model() starts with _reset_hand(): 50 simulated steps from mj_resetData's state to the
    # hand's start, the same steps for every layout when reset_model() changes nothing in the model but sites and
    # joint positions. True (with reset_model_once): simulate them once per env and copy the result afterwards
    # (_ReplayedHandReset); tests/integration/test_envs.py checks the whole MuJoCo state and every reset, bit for bit.
    replay_hand_reset: bool = False


DEFAULT_TASK = "pick-place-v3"
METAWORLD_MAX_PATH_LENGTH = 500  # Metaworld v3's max_path_length: its envs truncate every episode there
METAWORLD_STATE_DIM, METAWORLD_ACTION_DIM = 39, 4  # MT1's fully observable state; end-effector xyz and gripper
METAWORLD_CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "gripperPOV", "behindGripper")  # every task's scene

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("pick-place-v3", "pick up the block and place it at the goal", reset_model_once=True, replay_hand_reset=True),
        TaskSpec("reach-v3", "reach the goal position", reset_model_once=True, replay_hand_reset=True),
        TaskSpec("push-v3", "push the block to the goal", reset_model_once=True, replay_hand_reset=True),
        TaskSpec("door-open-v3", "open the door", reset_model_once=True),
        TaskSpec("drawer-open-v3", "open the drawer"),
        TaskSpec("drawer-close-v3", "close the drawer", reset_model_once=True),
        TaskSpec("button-press-topdown-v3", "press the button from the top", reset_model_once=True),
        TaskSpec("peg-insert-side-v3", "insert the peg into the hole from the side", reset_model_once=True),
        TaskSpec("window-open-v3", "slide the window open"),
        TaskSpec("window-close-v3", "slide the window closed"),
        # MT50's other forty, on Metaworld's own reset (no shortcut verified for them).
        TaskSpec("assembly-v3", "put the ring onto the peg"),
        TaskSpec("basketball-v3", "dunk the ball into the basket"),
        TaskSpec("bin-picking-v3", "move the block from one bin to the other"),
        TaskSpec("box-close-v3", "put the lid on the box"),
        TaskSpec("button-press-topdown-wall-v3", "press the button from the top behind the wall"),
        TaskSpec("button-press-v3", "press the button from the front"),
        TaskSpec("button-press-wall-v3", "press the button from the front behind the wall"),
        TaskSpec("coffee-button-v3", "press the coffee machine's button"),
        TaskSpec("coffee-pull-v3", "pull the mug away from the coffee machine"),
        TaskSpec("coffee-push-v3", "push the mug under the coffee machine"),
        TaskSpec("dial-turn-v3", "turn the dial"),
        TaskSpec("disassemble-v3", "take the ring off the peg"),
        TaskSpec("door-close-v3", "close the door"),
        TaskSpec("door-lock-v3", "lock the door by turning the lock"),
        TaskSpec("door-unlock-v3", "unlock the door by turning the lock"),
        TaskSpec("hand-insert-v3", "put the block into the hole"),
        TaskSpec("faucet-open-v3", "turn the faucet on"),
        TaskSpec("faucet-close-v3", "turn the faucet off"),
        TaskSpec("hammer-v3", "hammer the nail into the wall"),
        TaskSpec("handle-press-side-v3", "press the handle down from the side"),
        TaskSpec("handle-press-v3", "press the handle down"),
        TaskSpec("handle-pull-side-v3", "pull the handle up from the side"),
        TaskSpec("handle-pull-v3", "pull the handle up"),
        TaskSpec("lever-pull-v3", "pull the lever up"),
        TaskSpec("pick-place-wall-v3", "pick up the block and place it at the goal behind the wall"),
        TaskSpec("pick-out-of-hole-v3", "pick the block out of the hole"),
        TaskSpec("plate-slide-v3", "slide the plate into the goal"),
        TaskSpec("plate-slide-side-v3", "slide the plate into the goal from the side"),
        TaskSpec("plate-slide-back-v3", "slide the plate back out of the goal"),
        TaskSpec("plate-slide-back-side-v3", "slide the plate back out of the goal from the side"),
        TaskSpec("peg-unplug-side-v3", "unplug the peg from the side"),
        TaskSpec("soccer-v3", "kick the ball into the goal"),
        TaskSpec("stick-push-v3", "push the bottle with the stick"),
        TaskSpec("stick-pull-v3", "pull the bottle with the stick"),
        TaskSpec("push-wall-v3", "push the block to the goal behind the wall"),
        TaskSpec("push-back-v3", "pull the block back to the goal"),
        TaskSpec("reach-wall-v3", "reach the goal position behind the wall"),
        TaskSpec("shelf-place-v3", "place the block on the shelf"),
        TaskSpec("sweep-into-v3", "sweep the block into the hole"),
        TaskSpec("sweep-v3", "sweep the block off the table"),
    )
}

# Metaworld's own multi-task benchmarks, by their names in env.task.
TASK_SETS = {"MT10": tuple(metaworld.env_dict.MT10_V3), "MT50": tuple(metaworld.env_dict.MT50_V3)}

REWARD_MODES = ("success", "dense", "shaped")
DENSE_REWARD_SCALE = 10.0  # every v3 task pays at most 10 per step (at success)


# lerobot's Metaworld env (lerobot.envs.metaworld, env.type=metaworld): the state is the first four elements of the
# task's (hand position, gripper), and its one frame, observation.image, comes from "corner2" moved to where Metaworld's
# own "corner4" is and turned right way up: corner4's view, drawn at 480 x 480 with MuJoCo's default render settings.
LEROBOT_STATE_DIM = 4
LEROBOT_IMAGES = {"observation.image": "corner4"}


@functools.cache
def lerobot_sentences() -> dict[str, str]:
    """lerobot's sentence for each Metaworld task (its metaworld_config.json's TASK_DESCRIPTIONS), read from the installed
    lerobot's file without importing lerobot; a ConfigError when no lerobot is installed."""
    spec = importlib.util.find_spec("lerobot")
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    path = Path(folders[0]) / "envs" / "metaworld_config.json" if folders else None
    if path is None or not path.is_file():
        raise ConfigError(
            "env.observations 'lerobot' reads lerobot's Metaworld task sentences from its envs/metaworld_config.json, "
            "and no installed lerobot has one: install the smolvla or lerobot extra (docs/smolvla.md)"
        )
    return dict(json.loads(path.read_text())["TASK_DESCRIPTIONS"])


def _task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {sorted(TASKS)}")
    return TASKS[task]


# (task, benchmark seed) -> the benchmark's layouts as Metaworld Tasks, in `train_tasks` order. Building an MT1
# benchmark simulates 50 resets, so each seed is built once per machine: the goals it drew are kept
# in a JSON file (layout_cache_file) that every later process reads instead, and the run hands one process's tables
# to its rollout actors (MetaworldSuite.layout_tables -> adopt_benchmark_tasks) instead of each actor reading or building them.
_BENCHMARK_TASKS: dict[tuple[str, int], tuple[metaworld.Task, ...]] = {}

# How many layouts every MT1 benchmark draws (Metaworld's goals per task). Counting layouts by it needs no
# simulation, so a run is planned and checked before any benchmark is built; benchmark_tasks holds Metaworld to it.
LAYOUTS_PER_BENCHMARK = 50


def layout_cache_file(task: str, benchmark_seed: int) -> Path:
    """Where the goals of one MT1 benchmark are kept, per Metaworld version (another version may draw others)."""
    return cache_dir("layouts") / f"metaworld-{importlib.metadata.version('metaworld')}" / f"{task}-seed{benchmark_seed}.json"


def _tasks_from_goals(task: str, goals: np.ndarray) -> tuple[metaworld.Task, ...]:
    """The Tasks MT1 makes from its goal vectors (50, D), byte for byte: the task's ML1 arguments but its id, the goal,
    the env class, and MT1's full observability, pickled in that order. Nothing here unpickles anything."""
    tasks = []
    for goal in goals:
        data = dict(metaworld.env_dict.ML1_ARGS_KWARGS[task]["kwargs"])
        del data["task_id"]
        data.update(rand_vec=np.array(goal, dtype=np.float64), env_cls=metaworld.env_dict.ALL_V3_ENVIRONMENTS[task])
        data.update(partially_observable=False)
        tasks.append(metaworld.Task(env_name=task, data=pickle.dumps(data)))
    return tuple(tasks)


def _read_layout_cache(task: str, benchmark_seed: int) -> tuple[metaworld.Task, ...] | None:
    """The benchmark's Tasks from its cache file, or None when there is none; a file that is not one (truncated,
    edited, another task's: the Tasks it rebuilds must hash to the digest written with it) is named in a warning and
    the benchmark is simulated again, which rewrites it."""
    path = layout_cache_file(task, benchmark_seed)
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text())
        goals = np.array(content["goals"], dtype=np.float64)
        if (content["task"], content["benchmark_seed"]) != (task, benchmark_seed):
            raise ValueError(f"it holds {content['task']} seed {content['benchmark_seed']}")
        if goals.ndim != 2 or len(goals) != LAYOUTS_PER_BENCHMARK or not np.isfinite(goals).all():
            raise ValueError(f"its goals have shape {goals.shape}, not ({LAYOUTS_PER_BENCHMARK}, D) finite values")
        tasks = _tasks_from_goals(task, goals)
        if _tasks_digest(tasks) != content["tasks_sha256"]:
            raise ValueError("its goals do not rebuild the Tasks it was written from (tasks_sha256)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path} is not a layout table ({exc}): simulating {task} benchmark seed {benchmark_seed} again", stacklevel=3)
        return None
    return tasks


def _tasks_digest(tasks: tuple[metaworld.Task, ...]) -> str:
    return hashlib.sha256(b"".join(task_.env_name.encode() + task_.data for task_ in tasks)).hexdigest()


def _write_layout_cache(task: str, benchmark_seed: int, tasks: tuple[metaworld.Task, ...]) -> None:
    """Keep the benchmark's goals for later processes, atomically; only when they rebuild its Tasks byte for byte
    (another Metaworld could encode them otherwise), and a cache that cannot be written costs time, not the run."""
    goals = np.stack([pickle.loads(task_.data)["rand_vec"] for task_ in tasks])  # Metaworld's bytes, made in this process
    if _tasks_from_goals(task, goals) != tasks:
        return
    path = layout_cache_file(task, benchmark_seed)
    content = {"task": task, "benchmark_seed": benchmark_seed, "goals": goals.tolist(), "tasks_sha256": _tasks_digest(tasks)}
    try:
        write_file_atomically(path, json.dumps(content))
    except CheckpointWriteError as exc:
        warnings.warn(
            f"could not keep the layouts of {task} benchmark seed {benchmark_seed} in {path} ({exc}): every process will simulate them",
            stacklevel=3,
        )


def benchmark_tasks(task: str, benchmark_seed: int) -> tuple[metaworld.Task, ...]:
    key = (task, benchmark_seed)
    if key not in _BENCHMARK_TASKS:
        tasks = _read_layout_cache(task, benchmark_seed)
        if tasks is None:
            tasks = tuple(metaworld.MT1(task, seed=benchmark_seed).train_tasks)
            if len(tasks) != LAYOUTS_PER_BENCHMARK:
                raise RuntimeError(
                    f"metaworld.MT1({task!r}, seed={benchmark_seed}) drew {len(tasks)} layouts, not the "
                    f"{LAYOUTS_PER_BENCHMARK} that common.suites.metaworld.LAYOUTS_PER_BENCHMARK counts on"
                )
            _write_layout_cache(task, benchmark_seed, tasks)
        _BENCHMARK_TASKS[key] = tasks
    return _BENCHMARK_TASKS[key]


def held_benchmark_tasks(task: str, benchmark_seeds: Sequence[int]) -> dict[tuple[str, int], tuple[metaworld.Task, ...]]:
    """The tables of these benchmark seeds that this process holds, or reads from their cache files (none is
    simulated here)."""
    held = {}
    for seed in benchmark_seeds:
        key = (task, seed)
        if key not in _BENCHMARK_TASKS and (cached := _read_layout_cache(task, seed)) is not None:
            _BENCHMARK_TASKS[key] = cached
        if key in _BENCHMARK_TASKS:
            held[key] = _BENCHMARK_TASKS[key]
    return held


def adopt_benchmark_tasks(tables: dict[tuple[str, int], tuple[metaworld.Task, ...]]) -> None:
    """Use layouts another process built (benchmark_task_tables): the same Tasks, without simulating them again."""
    _BENCHMARK_TASKS.update(tables)


class _CameraRenderer:
    """Renders RGB frames of one scene camera: fast (ImageConfig.fast: no multisampling, shadows or reflections, which
    cost most of a software-rendered frame and add little at policy-input resolutions; docs/performance.md) or with
    MuJoCo's default settings, as gymnasium's MuJoCo renderer draws for lerobot's env."""

    def __init__(self, model: mujoco.MjModel, data: mujoco.MjData, config: ImageConfig, offsamples: int) -> None:
        """offsamples: the model's own multisampling, which a default-settings context is made with."""
        self._camera_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, config.camera)
        if self._camera_id == -1:
            known = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
            raise ValueError(f"ImageConfig.camera {config.camera!r} is not in the scene; known cameras: {known}")
        # The render context reads the framebuffer size and sample count when it is created.
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, config.width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, config.height)
        model.vis.quality.offsamples = 0 if config.fast else offsamples
        try:
            self._renderer = mujoco.Renderer(model, height=config.height, width=config.width)
        except mujoco.FatalError as error:
            # MuJoCo fixes its GL backend at import time, so a mujoco import that ran before this
            # module set MUJOCO_GL leaves it without a headless backend.
            raise RuntimeError(
                "no OpenGL context for rendering: MuJoCo picks its GL backend when first imported, "
                "which happened before MUJOCO_GL was set. Export MUJOCO_GL=egl, or import "
                "common.suites.metaworld before anything that imports mujoco"
            ) from error
        if config.fast:
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        # Several Metaworld cameras ("corner", "corner2", "corner3") are defined with their image-up
        # axis pointing below the horizon, so their raw frames are upside down. Rotating by 180
        # degrees is what turning the camera right way up about its optical axis would show; a
        # vertical flip alone would also mirror the scene. Column 1 of cam_xmat is the up axis.
        up_axis = data.cam_xmat[self._camera_id].reshape(3, 3)[:, 1]
        self._upside_down = bool(up_axis[2] < 0.0)

    def render(self, data: mujoco.MjData) -> np.ndarray:
        self._renderer.update_scene(data, camera=self._camera_id)
        frame = self._renderer.render()
        if self._upside_down:
            frame = np.ascontiguousarray(frame[::-1, ::-1])
        return frame

    def close(self) -> None:
        self._renderer.close()


def _touching_object(env: Any, object_geom_id: int) -> bool:
    """Metaworld's SawyerXYZEnv.touching_object (both gripper pads press on the object: their contacts with it carry a
    positive summed force), reading the contact arrays at once instead of one Python object per contact.

    Metaworld evaluates it on every step of the grasping tasks, and its loop over data.contact was about a quarter of a
    step's CPU, more the more contacts there are: the real policy's grasps cost more per step than random actions. The
    forces are summed in Metaworld's order, from 0, so the result is the same bit for bit (tests/integration/test_envs.py)."""
    contact = env.data.contact
    geom1, geom2 = contact.geom1, contact.geom2
    touches_object = (geom1 == object_geom_id) | (geom2 == object_geom_id)

    def pad_force(pad: str) -> float:
        pad_id = env.data.geom(pad).id
        rows = contact.efc_address[touches_object & ((geom1 == pad_id) | (geom2 == pad_id))]
        return sum(env.data.efc_force[rows].tolist())

    return 0 < pad_force("leftpad_geom") and 0 < pad_force("rightpad_geom")


class _ModelCompiledOnce:
    """Mixed into a Metaworld env class (_env_class): its MuJoCo model is compiled from the XML once per process and
    copied for every later env (mj_copyModel, much cheaper than compiling). An actor builds all its envs at start-up,
    so this is most of the time its envs take to build. Each env gets its own copy, since reset_model() moves sites
    and bodies in it."""

    # (XML path, render size) -> the model as gymnasium's MujocoEnv made it, before any env changed it
    _compiled: dict[tuple[str, int, int], mujoco.MjModel] = {}

    def _initialize_simulation(self) -> tuple[mujoco.MjModel, mujoco.MjData]:
        key = (self.fullpath, self.width, self.height)
        if key not in self._compiled:
            model, _ = super()._initialize_simulation()
            self._compiled[key] = copy.copy(model)
        model = copy.copy(self._compiled[key])
        return model, mujoco.MjData(model)


@functools.cache
def _env_class(task: str) -> type:
    """Metaworld's env class for the task, compiling its model once per process (_ModelCompiledOnce)."""
    metaworld_class = metaworld.env_dict.ALL_V3_ENVIRONMENTS[task]
    return type(metaworld_class.__name__, (_ModelCompiledOnce, metaworld_class), {})


# MjData arrays that live in its arena, sized by the constraints of the last step (efc_*) and their islands: after
# mj_resetData they are empty, and set_state's mj_forward rebuilds them before reset_model() reads anything.
_ARENA_PREFIXES = ("efc_", "island_", "dof_island", "tree_island")


class _ReplayedHandReset:
    """Metaworld's SawyerXYZEnv._reset_hand, simulated on the env's first reset and copied on every later one.

    On the reset_model_once path (MetaworldTaskEnv._reset_simulation) reset_model() runs right after mj_resetData, so
    the hand's 50 steps start from the same state each time; on tasks whose TaskSpec says replay_hand_reset they also
    run in the same model, so they end in the same state. That state is every fixed-size MjData array (positions,
    velocities, warm start, and what the last step derived from them, such as the sites reset_model() reads next)
    and the simulation time. Copying it costs far less than simulating it (docs/performance.md)."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self._simulate = env._reset_hand  # Metaworld's own, bound to env
        data = env.data
        self._names = [
            name for name in dir(data) if not name.startswith(("_", *_ARENA_PREFIXES)) and isinstance(getattr(data, name, None), np.ndarray)
        ]
        self._key: tuple[int, bytes] | None = None
        self._arrays: dict[str, np.ndarray] = {}
        self._time = 0.0

    def __call__(self, steps: int = 50) -> None:
        env = self._env
        key = (steps, np.asarray(env.hand_init_pos, dtype=np.float64).tobytes())
        if key != self._key:
            self._simulate(steps)
            self._arrays = {name: array.copy() for name, array in self._state_arrays().items()}
            self._key, self._time = key, env.data.time
            return
        for name, array in self._state_arrays().items():
            np.copyto(array, self._arrays[name])
        env.data.time = self._time
        env.init_tcp = env.tcp_center  # as _reset_hand ends

    def _state_arrays(self) -> dict[str, np.ndarray]:
        data = self._env.data
        return {name: getattr(data, name) for name in self._names}


class MetaworldTaskEnv(SuiteEnv):
    """One Metaworld task as a gymnasium env with a settable layout.

    Observations are the float32 state vector, or {"state", "image"} when `image` is given (a frame
    rendered after every step). `cameras` are rendered only on demand, by `render_cameras()`: a policy
    acting once per action chunk needs one frame per decision, not one per step.
    Rewards: "success" pays 1.0 on the step where success first becomes true (0 otherwise);
    "dense" is Metaworld's shaped reward (0..10); "shaped" pays as "success" does and reports that reward over 10 as
    info["shaping_potential"]. Call `close()` to free the render context.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        task: str,
        max_episode_steps: int = 200,
        stop_on_success: bool = True,
        reward: str = "success",
        image: ImageConfig | None = None,
        cameras: Sequence[ImageConfig] = (),
        layout: Layout | None = None,
        metaworld_shortcuts: bool = True,
        lerobot_observations: bool = False,
    ) -> None:
        """layout: the one used until set_layout (a rollout actor passes one of its own benchmark seeds, so that it
        builds no benchmark seed 0 just to start). metaworld_shortcuts: the faster reset (TaskSpec.reset_model_once)
        and contact check (_touching_object), both bit for bit Metaworld's; False runs Metaworld's own, for
        bench/env_step.py's comparison. lerobot_observations: the state is lerobot's (its first LEROBOT_STATE_DIM
        elements) and the instruction lerobot's sentence (env.observations "lerobot")."""
        self.task = task
        self.instruction = lerobot_sentences()[task] if lerobot_observations else _task_spec(task).instruction
        self._state_size = LEROBOT_STATE_DIM if lerobot_observations else METAWORLD_STATE_DIM
        self._reset_model_once = metaworld_shortcuts and _task_spec(task).reset_model_once
        if reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}")
        self._reward_mode = reward
        self._stop_on_success = stop_on_success

        self._layout = layout or Layout(task, 0, 0)
        self._env = _env_class(task)()  # MT1's train_classes[task], without building an MT1
        if metaworld_shortcuts:
            self._env.touching_object = types.MethodType(_touching_object, self._env)
        if self._reset_model_once and _task_spec(task).replay_hand_reset:
            self._env._reset_hand = _ReplayedHandReset(self._env)
        # Metaworld refuses to step past its own path length, so a longer limit cannot be honoured.
        if not 1 <= max_episode_steps <= self._env.max_path_length:
            raise ValueError(f"max_episode_steps must be in [1, {self._env.max_path_length}], got {max_episode_steps}")
        self._max_episode_steps = max_episode_steps
        # set_task makes the goal observable, which widens the goal bounds of
        # `sawyer_observation_space`; Metaworld's `observation_space` attribute keeps the stale ones.
        self.set_layout(self._layout)
        model, data = self._env.model, self._env.data
        offsamples = model.vis.quality.offsamples
        self._renderer = None if image is None else _CameraRenderer(model, data, image, offsamples)
        self._cameras = [_CameraRenderer(model, data, camera, offsamples) for camera in cameras]

        self.action_space = spaces.Box(-1.0, 1.0, shape=self._env.action_space.shape, dtype=np.float32)
        mw_space = self._env.sawyer_observation_space
        low, high = (bound[: self._state_size].astype(np.float32) for bound in (mw_space.low, mw_space.high))
        state_space = spaces.Box(low, high, dtype=np.float32)
        self._full_state = np.zeros(METAWORLD_STATE_DIM, dtype=np.float32)
        if image is None:
            self.observation_space = state_space
        else:
            image_space = spaces.Box(0, 255, shape=(image.height, image.width, 3), dtype=np.uint8)
            self.observation_space = spaces.Dict({"state": state_space, "image": image_space})

        self._episode_steps = 0
        self._succeeded = False
        self._needs_reset = True

    def _render_cameras(self) -> np.ndarray:
        return np.stack([camera.render(self._env.data) for camera in self._cameras])

    def set_layout(self, layout: Layout) -> None:
        """Use `layout` from the next reset on."""
        self.check_layout(layout)
        tasks = benchmark_tasks(self.task, layout.benchmark_seed)
        if not 0 <= layout.index < len(tasks):
            raise ValueError(f"layout index must be in [0, {len(tasks)}), got {layout.index}")
        self._env.set_task(tasks[layout.index])
        self._layout = layout
        self._needs_reset = True

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[GymObservation, dict]:
        # The seed only seeds `self.np_random` (gymnasium's contract); the episode itself is a
        # deterministic function of the layout.
        super().reset(seed=seed)
        layout = self.reset_layout(options)
        if layout is not None:
            self.set_layout(layout)
        state = self._reset_simulation() if self._reset_model_once else self._env.reset()[0]
        self._episode_steps = 0
        self._succeeded = False
        self._needs_reset = False
        return self._observation(state), {"layout": self._layout}

    def step(self, action: np.ndarray) -> tuple[GymObservation, float, bool, bool, dict]:
        action = self._checked_action(action, np.float32)
        state, dense_reward, _, _, mw_info = self._env.step(action)
        success = bool(mw_info["success"])
        reward, terminated, truncated = self._episode_rules(success, dense_reward)
        info = {**mw_info, "success": success}
        if self._reward_mode == "shaped":
            info["shaping_potential"] = float(dense_reward) / DENSE_REWARD_SCALE
        return self._observation(state), reward, terminated, truncated, info

    def _reset_simulation(self) -> np.ndarray:
        """Metaworld's own reset (SawyerXYZEnv.reset) less its first reset_model(), for tasks whose TaskSpec says that
        first call only costs time: it runs before MujocoEnv.reset's mj_resetData, and reset_model() then runs again
        from the same layout (50 simulated hand steps each). The lines after the
        base reset are SawyerXYZEnv.reset's own bookkeeping."""
        env = self._env
        env.curr_path_length = 0
        state, _ = MujocoEnv.reset(env)
        env._prev_obs = state[:18].copy()
        state[18:36] = env._prev_obs
        # Positions derived from the layout (the goal marker's site) as a frame rendered before the first step must
        # show them: a replayed hand reset leaves them from the episode that simulated it. Positions only; the next
        # step computes everything again from the same state.
        mujoco.mj_kinematics(env.model, env.data)
        return state.astype(np.float64)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        for camera in self._cameras:
            camera.close()
        self._cameras = []
        self._env.close()

    def _observation(self, state: np.ndarray) -> GymObservation:
        self._full_state = state.astype(np.float32)
        state = self._full_state[: self._state_size]
        if self._renderer is None:
            return state
        return {"state": state, "image": self._renderer.render(self._env.data)}

    def privileged_state(self) -> np.ndarray:
        return self._full_state


class ScriptedExpert:
    """Metaworld's hand-written policy for a task, acting on state observations."""

    def __init__(self, task: str) -> None:
        _task_spec(task)
        self._policy = ENV_POLICY_MAP[task]()

    def act(self, state_obs: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():
            # The policies use proportional gains that often saturate; the env clips anyway, and
            # the warning would otherwise fire on most steps.
            warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high")
            action = self._policy.get_action(np.asarray(state_obs, dtype=np.float64))
        return np.clip(action, -1.0, 1.0).astype(np.float32)


class FilmedTaskEnv(MetaworldTaskEnv):
    """A MetaworldTaskEnv that films its current episode into `frames`: the `film` camera's view after every step,
    (H, W, 3) uint8 each. Observations stay the state vectors of MetaworldTaskEnv and the policy's cameras are
    rendered on demand as there, so evaluation code runs on it unchanged.

    The view right after a reset is left out: on tasks whose reset replays the hand's steps (TaskSpec.replay_hand_reset)
    the goal marker is drawn where the env's first episode had it until the first step moves the scene on."""

    def __init__(self, config: EnvConfig, task: str, cameras: Sequence[ImageConfig], film: ImageConfig, layout: Layout) -> None:
        super().__init__(
            task,
            config.max_episode_steps,
            config.stop_on_success,
            config.reward,
            image=film,
            cameras=cameras,
            layout=layout,
            lerobot_observations=config.lerobot_observations,
        )
        self.observation_space = self.observation_space["state"]
        self.frames: list[np.ndarray] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        obs, info = super().reset(seed=seed, options=options)
        self.frames = []
        return obs["state"], info

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = super().step(action)
        self.frames.append(obs["image"])
        return obs["state"], reward, terminated, truncated, info


class MetaworldSuite(Suite):
    """Metaworld v3's tasks (TASKS), their MT1 benchmark layouts, and each task's scripted expert."""

    name = "metaworld"
    layouts_per_seed = LAYOUTS_PER_BENCHMARK
    task_sets = TASK_SETS
    state_size, action_size, camera_names = METAWORLD_STATE_DIM, METAWORLD_ACTION_DIM, METAWORLD_CAMERAS
    film_camera = "corner4"  # the view that keeps gripper, object and goal large and in frame
    offers_shaping = True  # Metaworld's dense reward over its scale
    lerobot_images, lerobot_state_size = LEROBOT_IMAGES, LEROBOT_STATE_DIM
    lerobot_frame_size, lerobot_fps, lerobot_robot = 480, 80, "sawyer"

    def instruction(self, task: str) -> str:
        spec = _task_spec(task)
        return lerobot_sentences()[task] if self.config.lerobot_observations else spec.instruction

    def episode_limit(self, task: str) -> int:
        _task_spec(task)
        return METAWORLD_MAX_PATH_LENGTH

    def build_env(self, task: str, cameras: Sequence[ImageConfig], layout: Layout, film: ImageConfig | None) -> MetaworldTaskEnv:
        if film is not None:
            return FilmedTaskEnv(self.config, task, cameras, film, layout)
        c = self.config
        return MetaworldTaskEnv(
            task,
            c.max_episode_steps,
            c.stop_on_success,
            c.reward,
            cameras=cameras,
            layout=layout,
            lerobot_observations=c.lerobot_observations,
        )

    def expert(self, task: str) -> ScriptedExpert:
        return ScriptedExpert(task)

    def layout_tables(self, task_seeds: Sequence[tuple[str, int]]) -> dict[tuple[str, int], tuple[metaworld.Task, ...]]:
        return {(task, seed): benchmark_tasks(task, seed) for task, seed in dict.fromkeys(task_seeds)}

    def held_layout_tables(self, task_seeds: Sequence[tuple[str, int]]) -> tuple[dict[tuple[str, int], Any], list[tuple[str, int]]]:
        held = {}
        for task, seed in task_seeds:
            held |= held_benchmark_tasks(task, [seed])
        return held, [key for key in task_seeds if key not in held]

    def adopt_layout_tables(self, tables: dict[tuple[str, int], tuple[metaworld.Task, ...]]) -> None:
        adopt_benchmark_tasks(tables)
