"""lerobot's own Metaworld, LIBERO and PushT envs beside the project's suites in lerobot's observations (env.observations
"lerobot"), and what a lerobot checkpoint's features make of a run's config (common.lerobot_checkpoint): the
observations, the cameras and their keys, the refusal of frames no layout gives with advice that works, and the base
checkpoints' cameras (smolvla_base's, pi0_base's, pi05_base's) on the GPU recipes through their camera maps. The
checkpoints here are config files carrying the features; their weights are another test's
(tests/integration/test_lerobot_round_trip.py)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from common.config import ConfigError
from common.config_loading import load_config
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.suites import ImageConfig, make_suite
from common.suites.metaworld import MetaworldTaskEnv, _tasks_from_goals
from learner.runtime.startup import preflight
from tests.conftest import REPO

install_cpu_torchvision_shim()
from lerobot.envs.metaworld import MetaworldEnv  # noqa: E402

TASK = "pick-place-v3"


def lerobot_config(directory: Path, images: dict[str, int], state: int, **fields) -> Path:
    """A lerobot SmolVLA checkpoint's config.json carrying these features (each frame's key -> its side)."""
    directory.mkdir(parents=True, exist_ok=True)
    features = {key: {"type": "VISUAL", "shape": [3, side, side]} for key, side in images.items()}
    content = {"type": "smolvla", "input_features": {**features, "observation.state": {"type": "STATE", "shape": [state]}},
               "output_features": {"action": {"type": "ACTION", "shape": [4]}}, **fields}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(content))
    return directory


def backbone(directory: Path) -> Path:
    """A directory standing in for a backbone's files (config.json is what the run looks for)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    return directory


def test_lerobots_metaworld_env_and_the_suite_give_the_same_state_sentence_frames_and_limit():
    """On one layout and the same actions: lerobot's agent_pos is the suite's state, its task description the suite's
    instruction, its 480-pixel frame the suite's corner4 frame drawn with MuJoCo's default settings, pixel for pixel after
    every step. The frame right after a reset is the one exception, by a bound: lerobot's env draws the goal marker where
    it stood before the reset (it moves the site after the last forward pass), the suite where it is."""
    config = load_config(overrides=["env.observations=lerobot", "policy.type=smolvla"])
    np.random.seed(3)  # lerobot's env draws each reset's layout from numpy's generator
    theirs = MetaworldEnv(TASK, obs_type="pixels_agent_pos")
    observation, _ = theirs.reset(seed=3)
    ours = MetaworldTaskEnv(TASK, max_episode_steps=config.env.max_episode_steps, lerobot_observations=True,
                            cameras=[ImageConfig(480, 480, "corner4", fast=False)])  # fmt: skip
    ours._env.set_task(_tasks_from_goals(TASK, theirs._env._last_rand_vec[None])[0])  # lerobot's layout as a Metaworld task
    state, _ = ours.reset()
    assert ours.instruction == theirs.task_description == make_suite(config.env).instruction(TASK)
    assert config.env.max_episode_steps == theirs._max_episode_steps == 500
    assert config.policy.cameras == ["corner4"] and config.policy.image_keys == ["observation.image"] and config.policy.obs_dim == 4
    first = np.abs(observation["pixels"].astype(int) - ours.render_cameras()[0].astype(int)).any(-1)
    assert 0 < first.mean() < 0.005, "the reset frame differs by the goal marker alone"
    rng = np.random.default_rng(0)
    try:
        for _ in range(8):
            np.testing.assert_allclose(state, observation["agent_pos"], atol=1e-6)
            action = rng.uniform(-1.5, 1.5, 4).astype(np.float32)  # beyond [-1, 1]: lerobot does not clip, the suite does
            observation, *_ = theirs.step(action)
            state, *_ = ours.step(action)
            np.testing.assert_array_equal(ours.render_cameras()[0], observation["pixels"])
        # Metaworld clips the hand's motion and MuJoCo the gripper's control, so the clip changes nothing
        np.testing.assert_array_equal(ours._env.data.qpos, theirs._env.data.qpos)
    finally:
        theirs.close()
        ours.close()


def test_a_lerobot_train_checkpoint_of_lerobots_metaworld_layout_sets_the_runs_observations(tmp_path):
    """init_checkpoint naming a checkpoint whose features are lerobot's Metaworld ones: the run reads lerobot's observations
    (its state, frame, camera, sentence and episode limit), the checkpoint's frame size, chunk and architecture, its local
    backbone, and builds its model from the checkpoint's file; the fields a config sets win."""
    vlm = backbone(tmp_path / "vlm")
    checkpoint = lerobot_config(tmp_path / "pretrained_model", {"observation.image": 480}, 4, chunk_size=4, num_vlm_layers=2,
                                vlm_model_name=str(vlm), tokenizer_max_length=24)  # fmt: skip
    config = load_config(overrides=[f"init_checkpoint={checkpoint}"])
    policy = config.policy
    assert (config.env.observations, config.env.fast_render, config.env.max_episode_steps) == ("lerobot", False, 500)
    assert (policy.type, policy.cameras, policy.image_keys) == ("smolvla", ["corner4"], ["observation.image"])
    assert (policy.image_size, policy.obs_dim) == (480, 4)
    assert (policy.chunk_size, policy.smolvla.num_vlm_layers, policy.smolvla.tokenizer_max_length) == (4, 2, 24)
    assert (policy.smolvla.vlm_path, policy.smolvla.lerobot_checkpoint) == (str(vlm), str(checkpoint))
    assert make_suite(config.env).instruction(TASK) == "Pick and place a puck to a goal"
    preflight(config, address=None, resume=False)
    kept = load_config(overrides=[f"init_checkpoint={checkpoint}", "env.max_episode_steps=200", "policy.chunk_size=4", "env.render=fast"])
    assert (kept.env.max_episode_steps, kept.env.fast_render) == (200, True)
    # without a checkpoint, "auto" is the project's observations: the embedded default is unchanged
    default = load_config()
    assert (default.env.observations, default.env.lerobot_observations, default.policy.obs_dim, default.env.max_episode_steps,
            default.env.fast_render) == ("auto", False, 39, 200, True)  # fmt: skip


def suggested_overrides(message: str) -> list[str]:
    """The --set overrides a refusal suggests."""
    return [shlex.split(f"--set {found}")[1] for found in re.findall(r"--set ('[^']+')", message)]


def test_a_checkpoint_whose_frames_no_layout_gives_is_refused_in_one_line_whose_advice_works(tmp_path):
    """A checkpoint reading a camera neither layout gives is refused before anything starts, in one line naming the frame
    and the rename_map that gives it; with that map the run's checks pass."""
    checkpoint = lerobot_config(tmp_path / "camera1", {"observation.images.camera1": 256}, 39, max_state_dim=39,
                                vlm_model_name=str(backbone(tmp_path / "vlm")))  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[f"init_checkpoint={checkpoint}"])
    message = str(refused.value)
    assert "\n" not in message and "observation.images.camera1" in message and "policy.rename_map" in message
    config = load_config(overrides=[f"init_checkpoint={checkpoint}", *suggested_overrides(message)])
    assert config.policy.image_keys == ["observation.images.camera1"] and config.env.observations == "project"
    preflight(config, address=None, resume=False)


def test_the_gpu_recipe_reads_smolvla_bases_cameras_through_its_camera_map(tmp_path):
    """configs/smolvla_pick.yaml on a stand-in carrying smolvla_base's features (observation.images.camera1..3 at 256
    pixels, a 6-element state, its chunk and backbone by hub id): its policy.rename_map gives those cameras Metaworld's
    frames, and its state projection is learnt anew; without the map the recipe is refused, naming it."""
    base = lerobot_config(tmp_path / "smolvla_base", {f"observation.images.camera{i}": 256 for i in (1, 2, 3)}, 6, chunk_size=50,
                          n_action_steps=50, max_state_dim=32, num_vlm_layers=16,
                          vlm_model_name="HuggingFaceTB/SmolVLM2-500M-Video-Instruct")  # fmt: skip
    paths = [f"policy.smolvla.lerobot_checkpoint={base}", f"policy.smolvla.vlm_path={backbone(tmp_path / 'vlm')}"]
    config = load_config(REPO / "configs" / "smolvla_pick.yaml", paths)
    assert config.policy.cameras == ["corner", "topview", "gripperPOV"]
    assert config.policy.image_keys == [f"observation.images.camera{i}" for i in (1, 2, 3)]
    assert (config.env.observations, config.policy.obs_dim) == ("project", 39)
    make_suite(config.env).check(config.policy)
    from learner.runtime.startup import check_features

    check_features(config, make_suite(config.env))
    recipe = yaml.safe_load((REPO / "configs" / "smolvla_pick.yaml").read_text())
    del recipe["policy"]["rename_map"]
    unmapped = tmp_path / "unmapped.yaml"
    unmapped.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError, match=r"reads observation\.images\.camera1.*policy\.rename_map"):
        load_config(unmapped, paths)


@pytest.mark.parametrize(("recipe", "kind"), [("pi0_pick.yaml", "pi0"), ("pi05_pick.yaml", "pi05")])
def test_the_pi_gpu_recipes_read_their_base_checkpoints_cameras_through_their_camera_maps(tmp_path, recipe, kind):
    """configs/pi0_pick.yaml and pi05_pick.yaml on stand-ins carrying pi0_base's and pi05_base's features (the cameras
    observation.images.base_0_rgb, left_wrist_0_rgb and right_wrist_0_rgb at 224 pixels, a 32-element state): their
    policy.rename_map gives those cameras Metaworld's frames and the run's checks pass; without the map the recipe is
    refused, naming it."""
    cameras = {f"observation.images.{name}": 224 for name in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")}
    base = lerobot_config(tmp_path / f"{kind}_base", cameras, 32, type=kind, chunk_size=50, max_state_dim=32, max_action_dim=32)
    paths = [f"policy.pi0.lerobot_checkpoint={base}", f"policy.pi0.tokenizer_path={backbone(tmp_path / 'tokenizer')}"]
    config = load_config(REPO / "configs" / recipe, paths)
    assert (config.policy.type, config.policy.image_keys) == (kind, list(cameras))
    assert config.policy.cameras == ["corner", "gripperPOV", "topview"] and config.env.observations == "project"
    make_suite(config.env).check(config.policy)
    from learner.runtime.startup import check_features

    check_features(config, make_suite(config.env))
    unmapped = yaml.safe_load((REPO / "configs" / recipe).read_text())
    del unmapped["policy"]["rename_map"]
    (tmp_path / "unmapped.yaml").write_text(yaml.safe_dump(unmapped))
    with pytest.raises(ConfigError, match=r"reads observation\.images\.base_0_rgb.*policy\.rename_map"):
        load_config(tmp_path / "unmapped.yaml", paths)


def test_lerobots_libero_env_and_the_suite_give_the_same_state_sentence_scene_and_limit_frames_within_a_bound():
    """lerobot's LiberoEnv reset with the seed the suite draws a layout's fixtures from, on LIBERO's init state of that
    layout, and the suite in lerobot's observations: the same simulator (fixture poses, positions, velocities), the same
    8-element state and sentence, lerobot's episode limit, and its frames under its keys. The frames agree within a
    bound, for a measured reason: robosuite samples its camera observations on a clock of its own inside the control
    step, where the suite draws the step's end; drawn at the same simulator state through robosuite's own render context,
    the suite's frames are robosuite's pixel for pixel."""
    from common.suites.gym_env import layout_seed
    from common.suites.libero import axis_angle, libero

    libero()  # LIBERO's config (LIBERO_CONFIG_PATH) before its first import, which asks for one otherwise
    from lerobot.envs.libero import LiberoEnv
    from libero.libero import benchmark

    config = load_config(overrides=["env.suite=libero", "env.task=libero_goal", "env.observations=lerobot", "policy.type=smolvla",
                                    "env.demo_benchmark_seed=3", "env.train_benchmark_seeds=[2]",
                                    "env.eval_benchmark_seeds=[0]"])  # fmt: skip
    assert config.policy.image_keys == ["observation.images.image", "observation.images.image2"] and config.policy.image_size == 256
    suite = make_suite(config.env)
    task = suite.tasks()[0]
    layout = suite.layouts(task, [0])[0]
    theirs = LiberoEnv(benchmark.get_benchmark_dict()["libero_goal"](), 0, "libero_goal", obs_type="pixels_agent_pos")
    observation, _ = theirs.reset(seed=layout_seed(layout))
    ours = suite.make_env(task, [ImageConfig(256, 256, camera) for camera in config.policy.cameras], layout)
    state, _ = ours.reset(options={"layout": layout})
    try:
        sim_theirs, sim_ours = theirs._env.sim, ours._env.sim
        np.testing.assert_array_equal(sim_theirs.model._model.body_pos, sim_ours.model._model.body_pos)
        np.testing.assert_array_equal(sim_theirs.data.qpos, sim_ours.data.qpos)
        eef = observation["robot_state"]["eef"]
        expected = np.concatenate([eef["pos"], axis_angle(eef["quat"]), observation["robot_state"]["gripper"]["qpos"]]).astype(np.float32)
        np.testing.assert_array_equal(state, expected)
        assert theirs.task_description == ours.instruction and config.env.max_episode_steps == theirs._max_episode_steps == 300
        frames = ours.render_cameras()
        for index, (camera, key, bound) in enumerate((("agentview", "image", 0.005), ("robot0_eye_in_hand", "image2", 0.05))):
            observed = observation["pixels"][key][::-1, ::-1]  # lerobot's LIBERO processor turns robosuite's frames by 180 degrees
            assert (observed != frames[index]).any(-1).mean() < bound, key
            drawn_now = np.asarray(sim_theirs.render(camera_name=camera, width=256, height=256))[::-1, ::-1]
            np.testing.assert_array_equal(drawn_now, frames[index])
    finally:
        theirs.close()
        ours.close()


def lerobot_eval_task(envs) -> list[str]:
    """The task lerobot-eval hands a policy for each of `envs` (a vector env), by its rule on both lerobot lines: the
    envs' task_description, else their task, else an empty sentence."""
    for name in ("task_description", "task"):
        try:
            return list(envs.call(name))
        except (AttributeError, NotImplementedError):
            continue
    return [""] * envs.num_envs


def test_lerobots_pusht_env_and_the_suite_give_the_same_state_frames_sentence_and_limit():
    """PushT in lerobot's observations beside lerobot's own env (make_env of its PushtEnv config, its observations through
    its preprocess_observation): reset with the layout's seed and stepped with the same actions, the pusher's position is
    the suite's state and the env's observed frame the suite's, pixel for pixel; the sentence is lerobot-eval's (empty)
    and the limit its 300 steps. The policy's [-1, 1] actions are the env's 0-512 pixels through policy.action_bounds,
    which the suite maps them onto."""
    from lerobot.envs.configs import PushtEnv
    from lerobot.envs.factory import make_env
    from lerobot.envs.utils import preprocess_observation

    from common.suites.base import Layout
    from common.suites.gym_env import layout_seed

    config = load_config(REPO / "configs" / "pusht.yaml", ["env.observations=lerobot", "policy.type=smolvla", "policy.image_size=96"])
    pusht = PushtEnv()
    assert (config.policy.cameras, config.policy.image_keys, config.policy.obs_dim) == (["pixels"], ["observation.image"], 2)
    assert config.policy.action_bounds == [0.0, 0.0, 512.0, 512.0] and config.env.max_episode_steps == pusht.episode_length == 300
    suite = make_suite(config.env)
    task = suite.tasks()[0]
    assert suite.image_sources(task) == {"observation.image": "pixels"} and suite.lerobot_fps == pusht.fps
    layout = Layout(task, config.env.train_benchmark_seeds[0], 3)
    ours = suite.make_env(task, [ImageConfig(96, 96, "pixels")], layout)
    theirs = make_env(pusht, n_envs=1)[pusht.type][0]
    low, high = np.asarray(config.policy.action_bounds[:2]), np.asarray(config.policy.action_bounds[2:])
    rng = np.random.default_rng(0)
    try:
        state, _ = ours.reset()
        raw, _ = theirs.reset(seed=[layout_seed(layout)])
        first = ours.render_cameras()[0]
        assert lerobot_eval_task(theirs) == [suite.instruction(task)] == [""]
        for step in range(12):
            given = preprocess_observation(raw)
            np.testing.assert_array_equal(given["observation.state"][0].numpy(), state)
            frame = (given["observation.image"][0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(ours.render_cameras()[0], frame)
            assert step == 0 or np.abs(frame.astype(int) - first.astype(int)).any(), "the frames follow the pusher"
            action = rng.uniform(-1, 1, 2).astype(np.float32)
            state, *_ = ours.step(action)
            pixels = low + (action.astype(np.float64) + 1.0) * 0.5 * (high - low)  # the suite's map onto the env's units
            raw, *_ = theirs.step(pixels[None].astype(np.float32))
    finally:
        ours.close()
        theirs.close()


def test_a_lerobot_pusht_checkpoint_sets_the_runs_observations_and_its_action_units(tmp_path):
    """init_checkpoint naming a checkpoint of lerobot's PushT features (one 96-pixel observation.image, the pusher's
    2-element position) on the PushT recipe: lerobot's observations, its camera, the env's pixels as the actions' units,
    lerobot's limit; the run's checks pass."""
    checkpoint = lerobot_config(tmp_path / "pretrained_model", {"observation.image": 96}, 2, chunk_size=4, num_vlm_layers=2,
                                vlm_model_name=str(backbone(tmp_path / "vlm")))  # fmt: skip
    config = load_config(REPO / "configs" / "pusht.yaml", [f"init_checkpoint={checkpoint}"])
    policy = config.policy
    assert (config.env.observations, policy.type, policy.cameras, policy.image_size) == ("lerobot", "smolvla", ["pixels"], 96)
    assert (config.policy.obs_dim, config.policy.action_dim, config.policy.action_bounds) == (2, 2, [0.0, 0.0, 512.0, 512.0])
    assert config.env.max_episode_steps == 300 and make_suite(config.env).instruction(config.env.task) == ""
    preflight(config, address=None, resume=False)
