# ruff: noqa: I001
# common.suites.metaworld must be imported before mujoco: it selects the headless GL backend (MUJOCO_GL=egl),
# which MuJoCo reads once at import time, so the import order here is deliberate.
from common.suites.metaworld import (
    DEFAULT_TASK,
    METAWORLD_ACTION_DIM,
    METAWORLD_MAX_PATH_LENGTH,
    METAWORLD_STATE_DIM,
    TASK_SETS,
    TASKS,
    ImageConfig,
    Layout,
    MetaworldSuite,
    MetaworldTaskEnv,
    ScriptedExpert,
)

import dataclasses
import json

import gymnasium.envs.mujoco.mujoco_env
import metaworld
import mujoco
import numpy as np
import pytest

from common.config import ConfigError, EnvConfig
from common.demonstrations import collect_demonstrations
from common.suites import SUITE_CLASSES, make_suite
from common.suites import metaworld as envs_module
from common.vector_env import ChunkedVectorEnv

SUITE = MetaworldSuite(EnvConfig())
layouts = SUITE.layouts

# Indices 4:7 of the state vector are the object position.
OBJECT_POS = slice(4, 7)


def _replay(env: MetaworldTaskEnv, layout: Layout, actions: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Plain single-env rollout of `actions` from `layout`; returns the last obs and the rewards."""
    obs, _ = env.reset(options={"layout": layout})
    rewards = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(reward)
        if terminated or truncated:
            break
    return obs, rewards


def _reset_obs(env: MetaworldTaskEnv, layout: Layout) -> np.ndarray:
    return env.reset(options={"layout": layout})[0]


def test_every_task_builds_and_has_an_expert():
    assert DEFAULT_TASK in TASKS and set(TASKS) == set(TASK_SETS["MT50"]) and set(TASK_SETS["MT10"]) < set(TASKS)
    for name, spec in TASKS.items():
        assert spec.name == name and spec.instruction
        ScriptedExpert(name)


def test_expert_solves_pick_place():
    episodes = collect_demonstrations(SUITE, DEFAULT_TASK, layouts(DEFAULT_TASK, [0])[:20], 0.0, 0)
    success_rate = float(np.mean([episode.success for episode in episodes]))
    assert success_rate >= 0.9


def test_state_observation_and_action_spaces():
    env = MetaworldTaskEnv(DEFAULT_TASK)
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.shape == (39,)
    assert env.observation_space.contains(obs)
    assert env.action_space.shape == (4,) and info["layout"] == Layout(DEFAULT_TASK, 0, 0)
    # Out-of-range actions are clipped rather than rejected.
    obs, reward, terminated, truncated, info = env.step(np.full(4, 5.0))
    assert env.observation_space.contains(obs) and isinstance(info["success"], bool)


def test_demonstrations_are_reproducible_per_seed():
    pool = layouts(DEFAULT_TASK, [0])[:3]
    first = collect_demonstrations(SUITE, DEFAULT_TASK, pool, action_noise=0.2, seed=0)
    again = collect_demonstrations(SUITE, DEFAULT_TASK, pool, action_noise=0.2, seed=0)
    other = collect_demonstrations(SUITE, DEFAULT_TASK, pool, action_noise=0.2, seed=1)
    for a, b in zip(first, again, strict=True):
        assert a.observations.dtype == np.float32 and a.actions.dtype == np.float32
        assert a.observations.shape[0] == a.actions.shape[0] and a.layout == b.layout
        np.testing.assert_array_equal(a.observations, b.observations)
        np.testing.assert_array_equal(a.actions, b.actions)
        assert np.abs(a.actions).max() <= 1.0
    assert any(a.actions.shape != c.actions.shape or not np.array_equal(a.actions, c.actions) for a, c in zip(first, other, strict=True))


def test_layouts_differ_across_benchmark_seeds_and_reset_is_deterministic():
    pool = layouts(DEFAULT_TASK, [0, 1])
    assert len(pool) == 100 and (pool[0], pool[50], pool[-1]) == (
        Layout(DEFAULT_TASK, 0, 0),
        Layout(DEFAULT_TASK, 1, 0),
        Layout(DEFAULT_TASK, 1, 49),
    )

    env = MetaworldTaskEnv(DEFAULT_TASK)
    seed0 = np.stack([_reset_obs(env, Layout(DEFAULT_TASK, 0, i)) for i in range(5)])
    seed1 = np.stack([_reset_obs(env, Layout(DEFAULT_TASK, 1, i)) for i in range(5)])
    assert not np.allclose(seed0[:, OBJECT_POS], seed1[:, OBJECT_POS])
    # Same layout after an unrelated episode in between: bit-identical initial observation.
    env.reset(options={"layout": Layout(DEFAULT_TASK, 1, 3)})
    for action in np.random.default_rng(0).uniform(-1, 1, (30, 4)):
        env.step(action)
    np.testing.assert_array_equal(_reset_obs(env, Layout(DEFAULT_TASK, 0, 2)), seed0[2])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_reset_and_steps_are_metaworlds_own_bit_for_bit(task):
    """MetaworldTaskEnv takes two shortcuts through Metaworld: it skips the first of the two reset_model() calls of a
    reset where its TaskSpec says so, and reads the gripper's contacts as arrays (_touching_object). Observations,
    rewards and every info field must still be Metaworld's exactly: a raw Metaworld env with the same layouts, reset
    its own way, driven by the same actions, episodes following each other as in training. The actions are the
    scripted expert's with noise, so the gripper really closes on the object, and the test checks that it did."""
    env = MetaworldTaskEnv(task, reward="dense", stop_on_success=False)
    raw = metaworld.env_dict.ALL_V3_ENVIRONMENTS[task]()
    expert, rng = ScriptedExpert(task), np.random.default_rng(0)
    grasped = 0
    for index in (0, 17, 49):
        layout = Layout(task, 2, index)
        raw.set_task(envs_module.benchmark_tasks(task, layout.benchmark_seed)[index])
        expected, _ = raw.reset()
        obs = _reset_obs(env, layout)
        np.testing.assert_array_equal(obs, expected.astype(np.float32))
        for _ in range(60):
            action = np.clip(expert.act(expected) + rng.normal(0.0, 0.3, 4), -1, 1).astype(np.float32)
            expected, want_reward, _, _, want_info = raw.step(action)
            obs, reward, _, _, info = env.step(action)
            np.testing.assert_array_equal(obs, expected.astype(np.float32))
            assert reward == float(want_reward)
            assert info == want_info
            grasped += bool(want_info.get("grasp_success", 0.0))
    if task == DEFAULT_TASK:
        assert grasped > 0, "the expert never grasped the block, so the contact check was not exercised"


def _mujoco_state(env: MetaworldTaskEnv) -> dict[str, np.ndarray]:
    """Everything MuJoCo holds for the env but its arena's scratch (efc_*, island arrays): the physics state and every
    quantity derived from it, with the simulation time."""
    data = env._env.data
    arrays = {name: getattr(data, name).copy() for name in dir(data) if not name.startswith(("_", *envs_module._ARENA_PREFIXES))
              and name != "timer" and isinstance(getattr(data, name, None), np.ndarray)}  # fmt: skip
    full = np.empty(mujoco.mj_stateSize(env._env.model, mujoco.mjtState.mjSTATE_FULLPHYSICS))
    mujoco.mj_getState(env._env.model, data, full, mujoco.mjtState.mjSTATE_FULLPHYSICS)
    return arrays | {"full_physics": full}


@pytest.mark.parametrize("task", sorted(name for name, spec in TASKS.items() if spec.replay_hand_reset))
def test_a_replayed_hand_reset_leaves_mujoco_and_the_env_as_simulating_it_does(task, monkeypatch):
    """The hand's 50 reset steps are simulated on an env's first reset and copied afterwards (replay_hand_reset).
    Against an env that simulates them every time: the same MuJoCo state after every reset (positions, velocities,
    warm start, every derived array, the time), the same Metaworld attributes (init_tcp, obj_init_pos, ...), and the
    same observations, rewards and infos on the steps after it, over layouts of two benchmark seeds and a repeated one,
    with episodes in between."""
    replaying = MetaworldTaskEnv(task, reward="dense", stop_on_success=False)
    monkeypatch.setitem(TASKS, task, dataclasses.replace(TASKS[task], replay_hand_reset=False))
    simulating = MetaworldTaskEnv(task, reward="dense", stop_on_success=False)
    hand_reset = replaying._env._reset_hand
    assert isinstance(hand_reset, envs_module._ReplayedHandReset)
    assert not isinstance(simulating._env._reset_hand, envs_module._ReplayedHandReset)
    simulated = []
    monkeypatch.setattr(hand_reset, "_simulate", lambda steps, simulate=hand_reset._simulate: (simulated.append(steps), simulate(steps)))
    rng = np.random.default_rng(0)
    for layout in (Layout(task, 2, 0), Layout(task, 2, 17), Layout(task, 3, 49), Layout(task, 2, 17)):
        np.testing.assert_array_equal(_reset_obs(replaying, layout), _reset_obs(simulating, layout))
        want, got = _mujoco_state(simulating), _mujoco_state(replaying)
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"MjData.{name} after resetting to {layout}")
        for name, value in vars(simulating._env).items():
            if isinstance(value, (np.ndarray, float, int)):
                np.testing.assert_array_equal(vars(replaying._env)[name], value, err_msg=f"{task}.{name} after resetting to {layout}")
        for action in rng.uniform(-1, 1, (40, 4)).astype(np.float32):
            obs, reward, _, _, info = replaying.step(action)
            want_obs, want_reward, _, _, want_info = simulating.step(action)
            np.testing.assert_array_equal(obs, want_obs)
            assert (reward, info) == (want_reward, want_info)
    assert simulated == [50], "the hand reset was simulated again instead of replayed"


def test_envs_after_the_first_copy_the_compiled_model_and_get_every_byte_of_a_fresh_compile(monkeypatch):
    """A process compiles a task's MuJoCo model once; every later env gets a copy of it (its own, since resets move
    sites and bodies in it), equal to a fresh compile of the XML in every byte of the saved model, and an env that
    has changed its copy changes no other env's."""

    def model_bytes(model: mujoco.MjModel) -> bytes:
        buffer = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
        mujoco.mj_saveModel(model, None, buffer)
        return buffer.tobytes()

    first = MetaworldTaskEnv(DEFAULT_TASK)
    fresh = metaworld.env_dict.ALL_V3_ENVIRONMENTS[DEFAULT_TASK]()  # Metaworld's own class: compiles the XML
    _reset_obs(first, Layout(DEFAULT_TASK, 2, 5))  # moves the goal site in first's model
    monkeypatch.setattr(gymnasium.envs.mujoco.mujoco_env.MujocoEnv, "_initialize_simulation",
                        lambda self: pytest.fail("compiled the XML again"))  # fmt: skip
    second = MetaworldTaskEnv(DEFAULT_TASK)
    assert second._env.model is not first._env.model
    assert model_bytes(second._env.model) == model_bytes(fresh.model)
    assert model_bytes(first._env.model) != model_bytes(fresh.model)


def test_chunk_truncated_mid_chunk_matches_single_env_replay():
    """max_episode_steps=6 with H=4: the second chunk runs 2 steps, then the env auto-resets."""
    horizon, max_steps, gamma = 4, 6, 0.9

    def make_env() -> MetaworldTaskEnv:
        # Dense rewards make the discounted-sum check non-trivial.
        return MetaworldTaskEnv(DEFAULT_TASK, max_episode_steps=max_steps, reward="dense")

    envs = [make_env(), make_env()]
    vec = ChunkedVectorEnv(envs, layouts(DEFAULT_TASK, [0])[:10], gamma)
    start = vec.reset(seed=3)
    start_layouts = [env.layout for env in envs]
    chunks = np.random.default_rng(0).uniform(-1, 1, (2, 2, horizon, 4)).astype(np.float32)
    first = vec.step_chunk(chunks[0])
    second = vec.step_chunk(chunks[1])

    np.testing.assert_array_equal(first.steps, [4, 4])
    np.testing.assert_array_equal(first.obs.state, first.next_obs.state)
    assert not (first.truncated.any() or first.terminated.any()) and first.episode_lengths == []
    np.testing.assert_array_equal(second.steps, [2, 2])
    assert second.truncated.all() and not second.terminated.any()
    np.testing.assert_array_equal(second.discount, np.full(2, gamma**2, dtype=np.float32))
    assert second.episode_lengths == [6, 6]

    reference = make_env()
    for i in range(2):
        np.testing.assert_array_equal(start.state[i], _reset_obs(reference, start_layouts[i]))
        whole_episode = np.concatenate([chunks[0, i], chunks[1, i]])
        final_obs, rewards = _replay(reference, start_layouts[i], whole_episode)
        assert len(rewards) == max_steps
        expected_first = sum(gamma**k * r for k, r in enumerate(rewards[:4]))
        expected_second = sum(gamma**k * r for k, r in enumerate(rewards[4:]))
        assert expected_second > 0
        np.testing.assert_allclose(first.reward[i], expected_first, rtol=1e-6)
        np.testing.assert_allclose(second.reward[i], expected_second, rtol=1e-6)
        np.testing.assert_allclose(second.episode_returns[i], sum(rewards), rtol=1e-6)
        np.testing.assert_array_equal(second.next_obs.state[i], final_obs)
        # obs is the new episode's first observation, from the layout drawn at the auto-reset.
        np.testing.assert_array_equal(second.obs.state[i], _reset_obs(reference, envs[i].layout))
        assert not np.array_equal(second.obs.state[i], second.next_obs.state[i])


def test_chunk_terminates_on_success_mid_chunk():
    layout = Layout(DEFAULT_TASK, 0, 4)
    demo = collect_demonstrations(SUITE, DEFAULT_TASK, [layout], action_noise=0.0, seed=0)[0]
    assert demo.success
    length = len(demo.actions)
    # Replaying the deterministic expert episode in chunks of H, success lands strictly inside a chunk.
    horizon = next(h for h in (4, 5, 6, 7) if length % h)
    padded = np.concatenate([demo.actions, np.zeros((horizon, 4), np.float32)])
    gamma = 0.95
    env = MetaworldTaskEnv(DEFAULT_TASK)  # reward="success", stop_on_success=True
    vec = ChunkedVectorEnv([env], [layout], gamma)
    vec.reset(seed=0)
    for start in range(0, length - length % horizon, horizon):
        result = vec.step_chunk(padded[None, start : start + horizon])
        assert result.steps[0] == horizon and not result.terminated[0] and result.reward[0] == 0.0
    result = vec.step_chunk(padded[None, length - length % horizon :][:, :horizon])

    steps = length % horizon
    assert result.steps[0] == steps < horizon
    assert result.terminated[0] and result.success[0] and not result.truncated[0]
    np.testing.assert_allclose(result.reward[0], gamma ** (steps - 1), rtol=1e-6)
    np.testing.assert_allclose(result.discount[0], gamma**steps, rtol=1e-6)
    assert result.episode_successes == [True] and result.episode_lengths == [length]
    assert result.episode_returns == [1.0]
    np.testing.assert_array_equal(result.obs.state[0], demo.observations[0])


def _shaped_chunks(task: str, layout: Layout, actions: np.ndarray, horizon: int, gamma: float, max_steps: int):
    """The vector env and the chunks it returns for `actions` (one episode) under env.reward "shaped", with the same
    episode's per-step success rewards and potentials (dense reward / 10), replayed on plain success and dense envs."""
    vec = ChunkedVectorEnv([MetaworldTaskEnv(task, max_episode_steps=max_steps, reward="shaped")], [layout], gamma)
    vec.reset(seed=0)
    chunks = []
    while not (chunks and (chunks[-1].terminated[0] or chunks[-1].truncated[0])):
        start = sum(int(chunk.steps[0]) for chunk in chunks)
        chunks.append(vec.step_chunk(actions[None, start : start + horizon]))
    dense = MetaworldTaskEnv(task, max_episode_steps=max_steps, reward="dense")
    _, dense_rewards = _replay(dense, layout, actions[: start + int(chunks[-1].steps[0])])
    _, success_rewards = _replay(MetaworldTaskEnv(task, max_episode_steps=max_steps), layout, actions[: len(dense_rewards)])
    return vec, chunks, np.array(success_rewards), np.array(dense_rewards) / 10.0


def _per_step_shaping(success_rewards, potentials, terminated: bool, gamma: float) -> np.ndarray:
    """r_t + gamma * phi_(t+1) - phi_t, step by step: the first step pays no shaping, the potential after a
    terminating step is 0."""
    after = potentials.copy()
    if terminated:
        after[-1] = 0.0
    before = np.concatenate([[gamma * potentials[0]], after[:-1]])
    return success_rewards + gamma * after - before


@pytest.mark.parametrize("ending", ["success", "time limit"])
def test_shaped_rewards_are_success_plus_potential_differences(ending):
    """env.reward "shaped": each chunk's reward is the discounted sum of the per-step shaped rewards, computed here from a
    dense env's rewards; over the episode they telescope to the success rewards plus gamma**T * phi_T - gamma * phi_1
    (phi_T = 0 when it terminates on success), and the episode's reported return stays the success one."""
    task, gamma, horizon = "reach-v3", 0.97, 7
    layout = Layout(task, 2, 5)
    if ending == "success":
        actions = np.array(collect_demonstrations(SUITE, task, [layout], action_noise=0.0, seed=0)[0].actions)
        max_steps = 200
    else:
        actions = np.random.default_rng(1).uniform(-1, 1, (23, 4)).astype(np.float32)
        max_steps = 23
    vec, chunks, success_rewards, potentials = _shaped_chunks(task, layout, actions, horizon, gamma, max_steps)
    terminated = bool(chunks[-1].terminated[0])
    assert terminated == (ending == "success") and len(chunks) > 2 and len(success_rewards) % horizon
    assert potentials.std() > 0.01  # the dense reward moves along the episode, so the shaping is not trivial

    shaped = _per_step_shaping(success_rewards, potentials, terminated, gamma)
    start = 0
    for chunk in chunks:
        steps = int(chunk.steps[0])
        expected = sum(gamma**i * r for i, r in enumerate(shaped[start : start + steps]))
        np.testing.assert_allclose(chunk.reward[0], expected, rtol=1e-5, atol=1e-6)
        start += steps
    discounts = np.cumprod([1.0] + [float(chunk.discount[0]) for chunk in chunks[:-1]])
    total = sum(factor * float(chunk.reward[0]) for factor, chunk in zip(discounts, chunks))
    steps = len(success_rewards)
    last_potential = 0.0 if terminated else potentials[-1]
    telescoped = sum(gamma**t * r for t, r in enumerate(success_rewards)) + gamma**steps * last_potential - gamma * potentials[0]
    np.testing.assert_allclose(total, telescoped, rtol=1e-5, atol=1e-5)
    assert chunks[-1].episode_returns == [float(success_rewards.sum())] == [1.0 if terminated else 0.0]

    # The next episode starts afresh: its first step pays no shaping from the last one's potential.
    assert vec._potentials == [None]
    again = vec.step_chunk(np.zeros((1, 1, 4), np.float32))
    assert again.reward[0] == 0.0 and vec._potentials[0] is not None


def test_layout_draws_are_reproducible():
    pool = layouts(DEFAULT_TASK, [0])

    def drawn_layouts(seed: int) -> list[Layout]:
        envs = [MetaworldTaskEnv(DEFAULT_TASK) for _ in range(3)]
        ChunkedVectorEnv(envs, pool, gamma=0.99).reset(seed)
        return [env.layout for env in envs]

    assert drawn_layouts(7) == drawn_layouts(7)
    assert drawn_layouts(7) != drawn_layouts(8)


def _reference_frame(layout: Layout, config: ImageConfig) -> np.ndarray:
    """A frame from the same camera physically turned right way up (rotated 180 degrees about its
    optical axis), rendered by MuJoCo with default settings and no post-processing."""
    benchmark = metaworld.MT1(DEFAULT_TASK, seed=layout.benchmark_seed)
    env = benchmark.train_classes[DEFAULT_TASK]()
    env.set_task(benchmark.train_tasks[layout.index])
    env.reset()
    camera = mujoco.mj_name2id(env.model, mujoco.mjtObj.mjOBJ_CAMERA, config.camera)
    turned = np.empty(4)
    mujoco.mju_mulQuat(turned, env.model.cam_quat[camera].copy(), np.array([0.0, 0.0, 0.0, 1.0]))
    env.model.cam_quat[camera] = turned
    mujoco.mj_forward(env.model, env.data)
    assert env.data.cam_xmat[camera].reshape(3, 3)[2, 1] > 0  # The image-up axis now points up.
    with mujoco.Renderer(env.model, height=config.height, width=config.width) as renderer:
        renderer.update_scene(env.data, camera=camera)
        return renderer.render()


def test_image_observations_are_right_way_up():
    """The raw "corner" camera is upside down. Our frame must match a render from the camera turned
    right way up far better than its vertical flip (missing flip), horizontal flip (mirror) or
    180-degree rotation (raw frame) do. Measured: ~5 grey levels mean error vs >= 33 for the rest,
    the residual being the shadows and anti-aliasing the fast settings turn off."""
    config = ImageConfig(width=96, height=64, camera="corner")  # Non-square catches transposes.
    env = MetaworldTaskEnv(DEFAULT_TASK, image=config)
    obs, _ = env.reset(options={"layout": Layout(DEFAULT_TASK, 0, 0)})
    stepped, *_ = env.step(np.zeros(4))
    env.close()
    image = obs["image"]
    assert image.shape == (64, 96, 3) and image.dtype == np.uint8
    assert obs["state"].shape == (39,) and obs["state"].dtype == np.float32
    assert env.observation_space.contains(obs) and stepped["image"].shape == (64, 96, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50

    reference = _reference_frame(Layout(DEFAULT_TASK, 0, 0), config).astype(np.int16)

    def error(frame: np.ndarray) -> float:
        return float(np.abs(frame.astype(np.int16) - reference).mean())

    wrong_orientations = [image[::-1], image[:, ::-1], image[::-1, ::-1]]
    assert error(image) < 0.5 * min(error(frame) for frame in wrong_orientations)


def test_clear_errors():
    with pytest.raises(ValueError, match="known tasks"):
        MetaworldTaskEnv("pick-plaice-v3")
    with pytest.raises(ValueError, match="known tasks"):
        ScriptedExpert("nope-v3")
    with pytest.raises(ValueError, match="reward"):
        MetaworldTaskEnv(DEFAULT_TASK, reward="sparse")
    with pytest.raises(ValueError, match="max_episode_steps"):
        MetaworldTaskEnv(DEFAULT_TASK, max_episode_steps=METAWORLD_MAX_PATH_LENGTH + 1)
    with pytest.raises(ValueError, match="ImageConfig.width"):
        ImageConfig(width=0)
    with pytest.raises(ValueError, match="ImageConfig.height"):
        ImageConfig(height=-3)
    with pytest.raises(ValueError, match="ImageConfig.camera"):
        MetaworldTaskEnv(DEFAULT_TASK, image=ImageConfig(camera="ceiling"))
    with pytest.raises(ValueError, match="observe a state vector"):
        image_env = MetaworldTaskEnv(DEFAULT_TASK, image=ImageConfig())
        try:
            ChunkedVectorEnv([image_env], [Layout(DEFAULT_TASK, 0, 0)], gamma=0.99)
        finally:
            image_env.close()
    env = MetaworldTaskEnv(DEFAULT_TASK)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(4))
    with pytest.raises(ValueError, match="layout index"):
        env.set_layout(Layout(DEFAULT_TASK, 0, 50))


def test_layouts_built_once_are_adopted_without_simulating_the_benchmark_again(monkeypatch) -> None:
    """The driver builds each benchmark seed's layouts once and hands them to every actor: an actor that adopts
    them builds no MT1 benchmark, and its envs reset to the same initial states."""
    tables = SUITE.layout_tables([("pick-place-v3", 2), ("pick-place-v3", 2), ("pick-place-v3", 3)])
    assert set(tables) == {("pick-place-v3", 2), ("pick-place-v3", 3)} and all(len(tasks) == 50 for tasks in tables.values())
    reference = MetaworldTaskEnv("pick-place-v3")
    reference.set_layout(Layout(DEFAULT_TASK, 3, 7))
    expected, _ = reference.reset(seed=0)
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda *args, **kwargs: pytest.fail("built an MT1 benchmark again"))
    envs_module.adopt_benchmark_tasks(tables)
    assert len(layouts("pick-place-v3", [2, 3])) == 100
    env = MetaworldTaskEnv("pick-place-v3", layout=Layout(DEFAULT_TASK, 2, 0))  # an actor's envs start on a training layout
    env.set_layout(Layout(DEFAULT_TASK, 3, 7))
    np.testing.assert_array_equal(env.reset(seed=0)[0], expected)


def test_counting_layouts_simulates_no_benchmark(tmp_path, monkeypatch) -> None:
    """A run is planned and checked (learner.runtime.startup.preflight) before any MT1 benchmark is built: layouts() counts by
    LAYOUTS_PER_BENCHMARK, and building a benchmark holds Metaworld to that count."""
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached layouts: benchmark_tasks must build
    real_mt1 = envs_module.metaworld.MT1
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda *args, **kwargs: pytest.fail("layouts() built an MT1 benchmark"))
    assert layouts("pick-place-v3", [5, 6])[-1] == Layout(DEFAULT_TASK, 6, envs_module.LAYOUTS_PER_BENCHMARK - 1)
    assert len(layouts("pick-place-v3", [5, 6])) == 2 * envs_module.LAYOUTS_PER_BENCHMARK

    class FewerLayouts:
        def __init__(self, task, seed):
            self.train_tasks = real_mt1(task, seed=seed).train_tasks[:49]

    monkeypatch.setattr(envs_module.metaworld, "MT1", FewerLayouts)
    with pytest.raises(RuntimeError, match="drew 49 layouts, not the 50"):
        envs_module.benchmark_tasks("pick-place-v3", 5)


def test_layouts_are_simulated_once_per_machine_and_a_bad_cache_file_is_named_and_rebuilt(tmp_path, monkeypatch) -> None:
    """A benchmark seed's layouts are simulated once and their goals kept in a JSON file; a process that starts later
    rebuilds the same Tasks from it, byte for byte, without an MT1. A file that is not a layout table (truncated,
    another seed's) is named in a warning and simulated again, which rewrites it; a cache that cannot be written costs
    only the time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    real_mt1 = envs_module.metaworld.MT1
    simulated = []
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda task, seed: (simulated.append(seed), real_mt1(task, seed=seed))[1])
    path = envs_module.layout_cache_file(DEFAULT_TASK, 4)
    built = envs_module.benchmark_tasks(DEFAULT_TASK, 4)
    assert built == tuple(real_mt1(DEFAULT_TASK, seed=4).train_tasks) and simulated == [4] and path.is_file()

    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})  # a later process
    assert envs_module.benchmark_tasks(DEFAULT_TASK, 4) == built and simulated == [4]  # the same bytes, no MT1
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    assert envs_module.held_benchmark_tasks(DEFAULT_TASK, [4, 5]) == {(DEFAULT_TASK, 4): built}  # 5: not cached, not built
    assert simulated == [4]

    good = path.read_text()
    edited = json.loads(good)
    edited["goals"][7][0] += 0.01  # a goal moved by hand
    for bad in (good[: len(good) // 2], good.replace('"benchmark_seed": 4', '"benchmark_seed": 3'), json.dumps(edited)):
        path.write_text(bad)
        monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
        with pytest.warns(UserWarning, match=f"{path.name} is not a layout table"):
            assert envs_module.benchmark_tasks(DEFAULT_TASK, 4) == built
        assert path.read_text() == good  # rewritten
    assert simulated == [4, 4, 4, 4]

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no_cache_here")
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    with pytest.warns(UserWarning, match="could not keep the layouts"):
        assert envs_module.benchmark_tasks(DEFAULT_TASK, 4) == built


@pytest.mark.parametrize("task", ["pick-place-v3", "drawer-open-v3"])
def test_the_frame_after_a_reset_shows_this_episodes_layout_whatever_came_before(task):
    """A frame rendered right after reset (the first decision's view) must not depend on the env's history: an env
    that visited other layouts first renders the same frame as a fresh one. The goal marker is a site placed by the
    layout; with the hand's reset replayed, nothing recomputed its position before the first step."""
    camera = ImageConfig(48, 48, "corner")
    travelled = MetaworldTaskEnv(task, cameras=[camera])
    for layout in (Layout(task, 2, 0), Layout(task, 3, 5)):
        travelled.reset(options={"layout": layout})
        travelled.step(np.zeros(4, np.float32))
    target = Layout(task, 2, 17)
    travelled.reset(options={"layout": target})
    fresh = MetaworldTaskEnv(task, cameras=[camera])
    fresh.reset(options={"layout": target})
    np.testing.assert_array_equal(travelled.render_cameras(), fresh.render_cameras())


def test_the_suite_declares_metaworlds_own_sizes_and_limit() -> None:
    """What MetaworldSuite says without building an env (its state and action sizes, the episode limit) is what every
    known task's env has; preflight refuses a run by these numbers."""
    for task in TASKS:
        env = SUITE.make_env(task)
        try:
            assert SUITE.sizes(task) == (env.observation_space.shape[0], env.action_space.shape[0])
            assert SUITE.episode_limit(task) == env._env.max_path_length
            assert SUITE.instruction(task) == env.instruction == TASKS[task].instruction
            model = env._env.model
            assert sorted(SUITE.cameras(task)) == sorted(mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam))
        finally:
            env.close()
    assert (METAWORLD_STATE_DIM, METAWORLD_ACTION_DIM) == SUITE.sizes(DEFAULT_TASK)
    with pytest.raises(ValueError, match="unknown task 'fly-v3'"):
        SUITE.sizes("fly-v3")


def test_env_suite_names_a_registry_line() -> None:
    assert isinstance(make_suite(EnvConfig()), MetaworldSuite) and list(SUITE_CLASSES) == ["metaworld", "gym", "libero"]
    with pytest.raises(ConfigError, match=r"env\.suite 'maniskill' is not one of \['gym', 'libero', 'metaworld'\]"):
        make_suite(EnvConfig(suite="maniskill"))
