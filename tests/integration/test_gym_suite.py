"""The gym suite (common/suites/gym_env.py): PushT through make_suite, and a small env registered here that succeeds,
renders and misbehaves on demand."""

from fractions import Fraction

import gymnasium
import numpy as np
import pytest
import yaml
from gymnasium import spaces

from common.config import ConfigError, EnvConfig, GymSuiteConfig, PolicyConfig, RunConfig
from common.config_loading import flatten, load_config
from common.suites import ImageConfig, Layout, make_suite
from common.suites.gym_env import LAYOUTS_PER_SEED, NO_EPISODE_LIMIT, layout_seed, resize_frame
from tests.conftest import REPO
from tests.helpers.errors import one_line_error

PUSHT = "gym_pusht/PushT-v0"
TOY = "flowrl_test/Toy-v0"
TOY_UNLIMITED = "flowrl_test/ToyUnlimited-v0"
BLIND = "flowrl_test/Blind-v0"  # renders no frames
TOY_BOUNDS = (np.array([-2.0, 0.0, 10.0], dtype=np.float32), np.array([2.0, 5.0, 11.0], dtype=np.float32))


class ToyEnv(gymnasium.Env):
    """Succeeds from step `succeed_at` on (info[success_key]), pays 0.25 x step as its reward, renders an 8 x 12
    frame drawn from its generator at every step, and records the actions it was given."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
    latest: "ToyEnv"

    def __init__(self, render_mode=None, observation="box", action="box", succeed_at=3, terminate_on_success=False,
                 success_key="done_flag", draws=True):  # fmt: skip
        self.render_mode, self.draws = render_mode, draws
        self.succeed_at, self.terminate_on_success, self.success_key = succeed_at, terminate_on_success, success_key
        box = spaces.Box(-1.0, 1.0, shape=(2, 3), dtype=np.float64)
        self.observation_space = box if observation == "box" else spaces.Dict({"pos": box, "flag": spaces.Discrete(2)})
        self.action_space = {
            "box": spaces.Box(*TOY_BOUNDS),
            "unbounded": spaces.Box(-np.inf, np.inf, (3,)),
            "discrete": spaces.Discrete(3),
        }[action]
        self.actions: list[np.ndarray] = []
        ToyEnv.latest = self

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-1.0, 1.0, size=(2, 3))
        self.steps, self.actions = 0, []
        self.frame = self.np_random.integers(0, 256, size=(8, 12, 3), dtype=np.uint8)
        return self._observation(), {}

    def step(self, action):
        self.steps += 1
        self.actions.append(np.array(action))
        self.frame = self.np_random.integers(0, 256, size=(8, 12, 3), dtype=np.uint8)
        success = self.steps >= self.succeed_at
        info = {"steps": self.steps, **({self.success_key: success} if self.success_key else {})}
        return self._observation(), 0.25 * self.steps, success and self.terminate_on_success, False, info

    def render(self):
        return self.frame.copy() if self.draws else None

    def _observation(self):
        position = self.position.copy()
        return position if isinstance(self.observation_space, spaces.Box) else {"pos": position, "flag": 0}


class BlindEnv(ToyEnv):
    metadata = {"render_modes": [], "render_fps": 10}


gymnasium.register(TOY, entry_point=ToyEnv, max_episode_steps=20)
gymnasium.register(TOY_UNLIMITED, entry_point=ToyEnv, max_episode_steps=None)
gymnasium.register(BLIND, entry_point=BlindEnv, max_episode_steps=20)


def pusht_suite(**gym):
    return make_suite(EnvConfig(suite="gym", task=PUSHT, gym=GymSuiteConfig(module="gym_pusht", kwargs={"obs_type": "state"}, **gym)))


def toy_suite(task=TOY, kwargs=None, **env):
    gym = {name: env.pop(name) for name in ("state_key", "success_key", "camera", "module") if name in env}
    gym.setdefault("success_key", "done_flag")
    return make_suite(EnvConfig(suite="gym", task=task, gym=GymSuiteConfig(kwargs=kwargs or {}, **gym), **env))


def area_mean_reference(frame, width, height):
    """Each output pixel as the exact mean (fractions) of the input area its cell covers, rounded half to even."""
    rows, columns = frame.shape[:2]

    def overlaps(pixels, cells):
        return [[max(Fraction(0), min(Fraction((i + 1) * pixels, cells), j + 1) - max(Fraction(i * pixels, cells), j))
                 for j in range(pixels)] for i in range(cells)]  # fmt: skip

    by_row, by_column = overlaps(rows, height), overlaps(columns, width)
    area = Fraction(rows, height) * Fraction(columns, width)
    out = np.zeros((height, width, 3), dtype=np.uint8)
    for i in range(height):
        for k in range(width):
            for c in range(3):
                total = sum(by_row[i][j] * by_column[k][m] * int(frame[j, m, c]) for j in range(rows) for m in range(columns))
                out[i, k, c] = round(total / area)
    return out


# PushT


def test_pusht_sizes_instruction_limit_and_state():
    suite = pusht_suite()
    assert suite.name == "gym" and suite.layouts_per_seed == 50 and suite.film_camera == "render"
    assert suite.sizes(PUSHT) == (5, 2)
    assert suite.instruction(PUSHT) == "push T"
    assert pusht_suite(instruction="push the T onto its target").instruction(PUSHT) == "push the T onto its target"
    assert suite.episode_limit(PUSHT) == 300
    assert suite.expert(PUSHT) is None
    assert suite.cameras(PUSHT) == ["render"] and pusht_suite(camera="top").cameras(PUSHT) == ["top"]
    env = suite.make_env(PUSHT)
    assert env.layout == Layout(PUSHT, suite.config.train_benchmark_seeds[0], 0)  # the first training layout
    state, info = env.reset()
    assert state.dtype == np.float32 and state.shape == (5,) and info == {"layout": env.layout}
    assert env.observation_space.shape == (5,) and env.action_space.shape == (2,)
    assert env.observation_space.contains(state)
    env.close()


def test_pusht_layouts_are_deterministic_and_distinct():
    suite = pusht_suite()
    layouts = suite.layouts(PUSHT, [2, 3])
    assert len(layouts) == 2 * LAYOUTS_PER_SEED and layouts[LAYOUTS_PER_SEED] == Layout(PUSHT, 3, 0)
    env, other = suite.make_env(PUSHT), suite.make_env(PUSHT, layout=layouts[7])
    initial = [env.reset(options={"layout": layout})[0].tobytes() for layout in layouts]
    assert len(set(initial)) == len(layouts)  # every layout its own initial state

    # The same layout again, after other episodes, in another env, or with a reset seed: the same state, bit for bit.
    assert other.reset()[0].tobytes() == initial[7]
    env.reset(options={"layout": layouts[3]})
    env.step(np.array([0.3, -0.2]))
    assert env.reset(seed=123, options={"layout": layouts[7]})[0].tobytes() == initial[7]
    assert env.reset()[0].tobytes() == initial[7]  # no option: the current layout

    # And the episode from it, given the same actions.
    actions = np.random.default_rng(0).uniform(-1.0, 1.0, size=(10, 2))
    env.reset()
    other.reset()
    assert [env.step(action)[0].tobytes() for action in actions] == [other.step(action)[0].tobytes() for action in actions]
    env.close()
    other.close()


def test_layout_seeds_are_distinct_across_the_default_seeds():
    seeds = {layout_seed(Layout(PUSHT, seed, index)) for seed in range(13) for index in range(LAYOUTS_PER_SEED)}
    assert len(seeds) == 13 * LAYOUTS_PER_SEED
    assert layout_seed(Layout(PUSHT, 2, 7)) == int(np.random.SeedSequence([2, 7]).generate_state(1)[0])
    for layout in (Layout(PUSHT, 0, LAYOUTS_PER_SEED), Layout(PUSHT, 0, -1), Layout(PUSHT, -1, 0)):
        one_line_error(ValueError, lambda layout=layout: layout_seed(layout), "layout")
    env = pusht_suite().make_env(PUSHT)
    one_line_error(ValueError, lambda: env.reset(options={"layout": Layout(PUSHT, 2, 50)}), "index in [0, 50)")
    one_line_error(ValueError, lambda: env.reset(options={"goal": 1}), "unknown reset options ['goal']")


def test_pusht_actions_map_onto_its_bounds():
    bounds = gymnasium.make(PUSHT).action_space  # PushT's own: target positions in [0, 512]^2
    assert bounds.low.tolist() == [0.0, 0.0] and bounds.high.tolist() == [512.0, 512.0]
    env = pusht_suite().make_env(PUSHT)
    env.reset()
    for action in ([-1.0, 1.0], [0.0, 0.5], [-0.25, 0.75], [3.0, -7.0]):
        env.step(np.array(action, dtype=np.float32))
        expected = [np.interp(a, [-1.0, 1.0], [0.0, 512.0]) for a in action]  # np.interp clamps outside [-1, 1]
        np.testing.assert_allclose(env._env.unwrapped._last_action, expected, rtol=0, atol=1e-4)  # what PushT was given
    one_line_error(ValueError, lambda: env.step(np.zeros(3)), "action must have shape (2,)")


def test_pusht_dict_observation_by_state_key():
    suite = make_suite(EnvConfig(suite="gym", task=PUSHT, gym=GymSuiteConfig(
        module="gym_pusht", kwargs={"obs_type": "environment_state_agent_pos"}, state_key="environment_state")))  # fmt: skip
    assert suite.sizes(PUSHT) == (16, 2)
    env = suite.make_env(PUSHT)
    state, _ = env.reset()
    keypoints = env._env.unwrapped.get_keypoints(env._env.unwrapped._block_shapes)  # PushT's own, (8, 2)
    assert state.dtype == np.float32 and np.array_equal(state, keypoints.reshape(-1).astype(np.float32))


def test_pusht_camera_frames_and_film():
    suite = pusht_suite()
    cameras = [ImageConfig(96, 96, "render"), ImageConfig(96, 96, "render")]
    env = suite.make_env(PUSHT, cameras=cameras, film=ImageConfig(40, 30, "render"))
    assert env.num_cameras == 2
    env.reset()
    frames = env.render_cameras()
    assert frames.shape == (2, 96, 96, 3) and frames.dtype == np.uint8
    view = env._env.render()  # PushT's own drawing
    assert np.array_equal(frames[0], resize_frame(view, 96, 96)) and np.array_equal(frames[0], frames[1])
    assert env.frames == []  # a film starts with the first step
    for _ in range(3):
        env.step(np.array([0.5, 0.5]))
    assert len(env.frames) == 3 and all(frame.shape == (30, 40, 3) and frame.dtype == np.uint8 for frame in env.frames)
    assert np.array_equal(env.frames[-1], resize_frame(env._env.render(), 40, 30))
    env.reset()
    assert env.frames == []
    env.close()


def test_pusht_check_refuses_a_policy_of_other_sizes():
    suite = pusht_suite()
    suite.check(PolicyConfig(obs_dim=5, action_dim=2))
    one_line_error(ConfigError, lambda: suite.check(PolicyConfig(obs_dim=39, action_dim=2)), "policy.obs_dim=39", "set policy.obs_dim=5")
    one_line_error(
        ConfigError, lambda: suite.check(PolicyConfig(obs_dim=5, action_dim=4)), "policy.action_dim=4", "set policy.action_dim=2"
    )
    long_episodes = make_suite(EnvConfig(suite="gym", task=PUSHT, max_episode_steps=301, gym=GymSuiteConfig(module="gym_pusht")))
    one_line_error(ConfigError, lambda: long_episodes.check(PolicyConfig(obs_dim=5, action_dim=2)), "env.max_episode_steps (301)", "(300)")
    # A gymnasium env reports no measure of progress the suite knows, so it gives no shaping potential.
    shaped = make_suite(EnvConfig(suite="gym", task=PUSHT, reward="shaped", gym=GymSuiteConfig(module="gym_pusht")))
    one_line_error(ConfigError, lambda: shaped.check(PolicyConfig(obs_dim=5, action_dim=2)), "env.reward 'shaped'", "gym has none")


def test_pusht_run_config_is_an_overlay_that_fits_the_suite():
    path = REPO / "configs" / "pusht.yaml"
    written, default = flatten(yaml.safe_load(path.read_text())), flatten(RunConfig().to_dict())
    assert [name for name, value in written.items() if default.get(name) == value] == []  # only what PushT changes
    config = load_config(path)
    assert (config.env.suite, config.env.task, config.env.gym.module) == ("gym", PUSHT, "gym_pusht")
    assert (config.policy.obs_dim, config.policy.action_dim) == (5, 2)  # the suite's widths, which the file leaves
    make_suite(config.env).check(config.policy)  # sizes and episode limit
    assert config.allow_random_init  # PushT has no scripted expert to pre-train on


# The toy env: actions, success, rewards, episode ends, cameras and errors


def test_actions_map_linearly_onto_the_box_after_clipping():
    env = toy_suite().make_env(TOY)
    env.reset()
    actions = [[-1.0, 1.0, 0.0], [0.5, -0.5, 0.25], [2.0, -3.0, 1.5]]
    for action in actions:
        env.step(np.array(action, dtype=np.float32))
    low, high = TOY_BOUNDS
    for action, given in zip(actions, ToyEnv.latest.actions):
        clipped = np.clip(action, -1.0, 1.0)
        expected = [np.interp(a, [-1.0, 1.0], [lo, hi]) for a, lo, hi in zip(clipped, low, high)]
        assert given.dtype == np.float32
        np.testing.assert_allclose(given, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stop_on_success", [True, False])
def test_success_rewards_pay_once_and_stop_on_success(stop_on_success):
    env = toy_suite(stop_on_success=stop_on_success, max_episode_steps=6).make_env(TOY)
    env.reset()
    rewards, successes, ends = [], [], []
    for _ in range(6):
        _, reward, terminated, truncated, info = env.step(np.zeros(3))
        rewards.append(reward)
        successes.append(info["success"])
        ends.append((terminated, truncated))
        assert type(info["success"]) is bool and info["done_flag"] == info["success"]
        if terminated or truncated:
            break
    if stop_on_success:
        assert rewards == [0.0, 0.0, 1.0] and successes == [False, False, True] and ends[-1] == (True, False)
    else:  # success holds from step 3 on; only the first pays, and the episode runs to its limit
        assert rewards == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0] and successes == [False, False] + [True] * 4
        assert ends == [(False, False)] * 5 + [(False, True)]
    one_line_error(RuntimeError, lambda: env.step(np.zeros(3)), "call reset() before step()")
    env.reset()  # a fresh episode pays again
    assert [env.step(np.zeros(3))[1] for _ in range(3)] == [0.0, 0.0, 1.0]


def test_dense_rewards_are_the_envs_own_and_its_own_termination_ends_the_episode():
    env = toy_suite(reward="dense", stop_on_success=False, kwargs={"terminate_on_success": True, "succeed_at": 4}).make_env(TOY)
    env.reset()
    steps = [env.step(np.zeros(3)) for _ in range(4)]
    assert [step[1] for step in steps] == [0.25, 0.5, 0.75, 1.0]
    assert [step[2] for step in steps] == [False, False, False, True]  # the env ended it, though stop_on_success is off
    one_line_error(RuntimeError, lambda: env.step(np.zeros(3)), "call reset() before step()")


def test_episode_limits():
    env = toy_suite(max_episode_steps=20, stop_on_success=False, kwargs={"succeed_at": 100}).make_env(TOY)
    env.reset()
    ends = [env.step(np.zeros(3))[2:4] for _ in range(20)]
    assert ends == [(False, False)] * 19 + [(False, True)]
    assert toy_suite().episode_limit(TOY) == 20
    assert toy_suite(kwargs={"max_episode_steps": 50}).episode_limit(TOY) == 50  # gymnasium.make's own argument
    assert toy_suite(task=TOY_UNLIMITED).episode_limit(TOY_UNLIMITED) == NO_EPISODE_LIMIT
    one_line_error(RuntimeError, lambda: toy_suite().make_env(TOY).step(np.zeros(3)), "call reset() before step()")


def test_dict_observation_state_is_the_keyed_box_flattened():
    suite = toy_suite(state_key="pos", kwargs={"observation": "dict"})
    assert suite.sizes(TOY) == (6, 3)
    env = suite.make_env(TOY)
    state, _ = env.reset()
    assert state.dtype == np.float32 and np.array_equal(state, ToyEnv.latest.position.reshape(-1).astype(np.float32))
    assert np.array_equal(env.observation_space.low, np.full(6, -1.0, dtype=np.float32))


def test_cameras_are_the_renders_area_averaged_and_film_keeps_each_step():
    env = toy_suite(kwargs={"succeed_at": 100}).make_env(TOY, cameras=[ImageConfig(6, 4, "render")], film=ImageConfig(12, 8, "render"))
    env.reset()
    frame = ToyEnv.latest.frame
    block_mean = np.rint(frame.reshape(4, 2, 6, 2, 3).astype(np.float64).mean(axis=(1, 3))).astype(np.uint8)
    rendered = env.render_cameras()
    assert rendered.shape == (1, 4, 6, 3) and rendered.dtype == np.uint8 and np.array_equal(rendered[0], block_mean)
    drawn = []
    for _ in range(4):
        env.step(np.zeros(3))
        drawn.append(ToyEnv.latest.frame)
    assert len(env.frames) == 4 and all(np.array_equal(kept, frame) for kept, frame in zip(env.frames, drawn))  # 12 x 8: as drawn
    env.reset()
    assert env.frames == []


def test_a_state_only_env_renders_nothing():
    env = toy_suite().make_env(TOY)
    assert env.num_cameras == 0 and ToyEnv.latest.render_mode is None
    one_line_error(RuntimeError, env.render_cameras, "needs cameras")
    with_camera = toy_suite().make_env(TOY, cameras=[ImageConfig(6, 4, "render")])
    assert ToyEnv.latest.render_mode == "rgb_array"
    one_line_error(RuntimeError, with_camera.render_cameras, "call reset() before rendering")


@pytest.mark.parametrize(
    ("width", "height"), [(6, 4), (4, 6), (14, 3), (3, 10), (21, 25), (5, 7), (1, 1), (28, 20), (14, 10)]
)  # fmt: skip
def test_resize_is_the_exact_area_mean(width, height):
    frame = np.random.default_rng(width * 100 + height).integers(0, 256, size=(10, 14, 3), dtype=np.uint8)
    assert np.array_equal(resize_frame(frame, width, height), area_mean_reference(frame, width, height))


def test_resize_reduces_by_block_means_and_enlarges_by_repeats():
    frame = np.random.default_rng(1).integers(0, 256, size=(680, 680, 3), dtype=np.uint8)
    block_mean = np.rint(frame.reshape(85, 8, 85, 8, 3).astype(np.float64).mean(axis=(1, 3))).astype(np.uint8)
    assert np.array_equal(resize_frame(frame, 85, 85), block_mean)
    small = frame[:5, :7]
    assert np.array_equal(resize_frame(small, 21, 10), small.repeat(2, axis=0).repeat(3, axis=1))
    assert np.array_equal(resize_frame(frame, 680, 680), frame)
    white = np.full((680, 680, 3), 255, dtype=np.uint8)
    assert np.array_equal(resize_frame(white, 96, 96), np.full((96, 96, 3), 255, dtype=np.uint8))


def test_one_line_errors_name_the_field():
    one_line_error(ValueError, lambda: toy_suite(kwargs={"action": "discrete"}).make_env(TOY), f"env.task {TOY}", "not a Box")
    one_line_error(ValueError, lambda: toy_suite(kwargs={"action": "unbounded"}).make_env(TOY), f"env.task {TOY}", "is unbounded")
    one_line_error(ValueError, lambda: toy_suite(state_key="speed", kwargs={"observation": "dict"}).sizes(TOY),
                   "env.gym.state_key 'speed'", "['flag', 'pos']")  # fmt: skip
    one_line_error(
        ValueError, lambda: toy_suite(kwargs={"observation": "dict"}).sizes(TOY), "env.gym.state_key is empty", "['flag', 'pos']"
    )
    one_line_error(ValueError, lambda: toy_suite(state_key="pos").sizes(TOY), "env.gym.state_key 'pos' is set", "Box")
    one_line_error(ValueError, lambda: toy_suite(kwargs={"colour": "red"}).sizes(TOY), "env.gym.kwargs {'colour': 'red'}", TOY)
    one_line_error(ValueError, lambda: toy_suite(kwargs={"colour": "red"}).make_env(TOY, cameras=[ImageConfig(6, 4, "render")]),
                   "env.gym.kwargs {'colour': 'red'} with render_mode 'rgb_array'")  # fmt: skip
    camera = ImageConfig(6, 4, "corner")
    one_line_error(ValueError, lambda: toy_suite().make_env(TOY, cameras=[camera]), "camera 'corner'", "['render'] (env.gym.camera)")
    one_line_error(ValueError, lambda: toy_suite().make_env(TOY, film=camera), "camera 'corner'", "['render']")

    no_success = toy_suite(kwargs={"success_key": ""}).make_env(TOY)
    no_success.reset()
    one_line_error(ValueError, lambda: no_success.step(np.zeros(3)), "env.gym.success_key 'done_flag'", "['steps']")

    one_line_error(ValueError, lambda: toy_suite(task="flowrl_test/Nothing-v0").instruction("flowrl_test/Nothing-v0"),
                   "'flowrl_test/Nothing-v0' is not a registered", "env.gym.module is empty")  # fmt: skip
    one_line_error(ValueError, lambda: pusht_suite().make_env("gym_pusht/PushT-v9"), "'gym_pusht/PushT-v9' is not a registered",
                   "env.gym.module 'gym_pusht' registers ['gym_pusht/PushT-v0']")  # fmt: skip
    one_line_error(ConfigError, lambda: toy_suite(task="flowrl_test/Nothing-v0").check(PolicyConfig()), "env.task:", "env.gym.module")
    one_line_error(ValueError, lambda: toy_suite(module="flowrl_no_such_module"), "env.gym.module 'flowrl_no_such_module'", TOY)


def test_an_env_without_frames_has_no_camera():
    toy_suite(task=BLIND).make_env(BLIND)  # state-only: fine
    one_line_error(ValueError, lambda: toy_suite(task=BLIND).make_env(BLIND, cameras=[ImageConfig(6, 4, "render")]),
                   f"{BLIND} renders no rgb_array frames", "camera 'render'")  # fmt: skip
    env = toy_suite(kwargs={"draws": False}).make_env(TOY, cameras=[ImageConfig(6, 4, "render")])
    env.reset()
    one_line_error(ValueError, env.render_cameras, f"{TOY}'s render() gave NoneType", "not an (H, W, 3) uint8 frame")
