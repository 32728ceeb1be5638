# ruff: noqa: I001
# common.envs must be imported before mujoco: it selects the headless GL backend (MUJOCO_GL=egl),
# which MuJoCo reads once at import time, so the import order here is deliberate.
from common.envs import (
    DEFAULT_TASK,
    TASKS,
    ChunkedVectorEnv,
    ImageConfig,
    Layout,
    MetaworldTaskEnv,
    ScriptedExpert,
    collect_demonstrations,
    evaluate_expert,
    layouts,
)

import metaworld
import mujoco
import numpy as np
import pytest

from common import envs as envs_module

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
    assert DEFAULT_TASK in TASKS and len(TASKS) == 10
    for name, spec in TASKS.items():
        assert spec.name == name and spec.instruction
        ScriptedExpert(name)


def test_expert_solves_pick_place():
    success_rate = evaluate_expert(DEFAULT_TASK, layouts(DEFAULT_TASK, [0])[:20], seed=0)
    assert success_rate >= 0.9


def test_state_observation_and_action_spaces():
    env = MetaworldTaskEnv(DEFAULT_TASK)
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.shape == (39,)
    assert env.observation_space.contains(obs)
    assert env.action_space.shape == (4,) and info["layout"] == Layout(0, 0)
    # Out-of-range actions are clipped rather than rejected.
    obs, reward, terminated, truncated, info = env.step(np.full(4, 5.0))
    assert env.observation_space.contains(obs) and isinstance(info["success"], bool)


def test_demonstrations_are_reproducible_per_seed():
    pool = layouts(DEFAULT_TASK, [0])[:3]
    first = collect_demonstrations(DEFAULT_TASK, pool, action_noise=0.2, seed=0)
    again = collect_demonstrations(DEFAULT_TASK, pool, action_noise=0.2, seed=0)
    other = collect_demonstrations(DEFAULT_TASK, pool, action_noise=0.2, seed=1)
    for a, b in zip(first, again, strict=True):
        assert a.observations.dtype == np.float32 and a.actions.dtype == np.float32
        assert a.observations.shape[0] == a.actions.shape[0] and a.layout == b.layout
        np.testing.assert_array_equal(a.observations, b.observations)
        np.testing.assert_array_equal(a.actions, b.actions)
        assert np.abs(a.actions).max() <= 1.0
    assert any(a.actions.shape != c.actions.shape or not np.array_equal(a.actions, c.actions) for a, c in zip(first, other, strict=True))


def test_layouts_differ_across_benchmark_seeds_and_reset_is_deterministic():
    pool = layouts(DEFAULT_TASK, [0, 1])
    assert len(pool) == 100 and pool[0] == Layout(0, 0) and pool[50] == Layout(1, 0) and pool[-1] == Layout(1, 49)

    env = MetaworldTaskEnv(DEFAULT_TASK)
    seed0 = np.stack([_reset_obs(env, Layout(0, i)) for i in range(5)])
    seed1 = np.stack([_reset_obs(env, Layout(1, i)) for i in range(5)])
    assert not np.allclose(seed0[:, OBJECT_POS], seed1[:, OBJECT_POS])
    # Same layout after an unrelated episode in between: bit-identical initial observation.
    env.reset(options={"layout": Layout(1, 3)})
    for action in np.random.default_rng(0).uniform(-1, 1, (30, 4)):
        env.step(action)
    np.testing.assert_array_equal(_reset_obs(env, Layout(0, 2)), seed0[2])


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
        layout = Layout(2, index)
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
    layout = Layout(0, 4)
    demo = collect_demonstrations(DEFAULT_TASK, [layout], action_noise=0.0, seed=0)[0]
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
    obs, _ = env.reset(options={"layout": Layout(0, 0)})
    stepped, *_ = env.step(np.zeros(4))
    env.close()
    image = obs["image"]
    assert image.shape == (64, 96, 3) and image.dtype == np.uint8
    assert obs["state"].shape == (39,) and obs["state"].dtype == np.float32
    assert env.observation_space.contains(obs) and stepped["image"].shape == (64, 96, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50

    reference = _reference_frame(Layout(0, 0), config).astype(np.int16)

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
        MetaworldTaskEnv(DEFAULT_TASK, max_episode_steps=501)
    with pytest.raises(ValueError, match="ImageConfig.width"):
        ImageConfig(width=0)
    with pytest.raises(ValueError, match="ImageConfig.height"):
        ImageConfig(height=-3)
    with pytest.raises(ValueError, match="ImageConfig.camera"):
        MetaworldTaskEnv(DEFAULT_TASK, image=ImageConfig(camera="ceiling"))
    with pytest.raises(NotImplementedError):
        image_env = MetaworldTaskEnv(DEFAULT_TASK, image=ImageConfig())
        try:
            ChunkedVectorEnv([image_env], [Layout(0, 0)], gamma=0.99)
        finally:
            image_env.close()
    env = MetaworldTaskEnv(DEFAULT_TASK)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(4))
    with pytest.raises(ValueError, match="layout index"):
        env.set_layout(Layout(0, 50))


def test_layouts_built_once_are_adopted_without_simulating_the_benchmark_again(monkeypatch) -> None:
    """The driver builds each benchmark seed's layouts once and hands them to every actor: an actor that adopts
    them builds no MT1 benchmark, and its envs reset to the same initial states."""
    tables = envs_module.benchmark_task_tables("pick-place-v3", [2, 2, 3])
    assert set(tables) == {("pick-place-v3", 2), ("pick-place-v3", 3)} and all(len(tasks) == 50 for tasks in tables.values())
    reference = MetaworldTaskEnv("pick-place-v3")
    reference.set_layout(Layout(3, 7))
    expected, _ = reference.reset(seed=0)
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda *args, **kwargs: pytest.fail("built an MT1 benchmark again"))
    envs_module.adopt_benchmark_tasks(tables)
    assert len(envs_module.layouts("pick-place-v3", [2, 3])) == 100
    env = MetaworldTaskEnv("pick-place-v3", layout=Layout(2, 0))  # an actor's envs start on a training layout
    env.set_layout(Layout(3, 7))
    np.testing.assert_array_equal(env.reset(seed=0)[0], expected)


def test_counting_layouts_simulates_no_benchmark(monkeypatch) -> None:
    """A run is planned and checked (learner.driver.preflight) before any MT1 benchmark is built: layouts() counts by
    LAYOUTS_PER_BENCHMARK, and building a benchmark holds Metaworld to that count."""
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    real_mt1 = envs_module.metaworld.MT1
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda *args, **kwargs: pytest.fail("layouts() built an MT1 benchmark"))
    assert envs_module.layouts("pick-place-v3", [5, 6])[-1] == Layout(6, envs_module.LAYOUTS_PER_BENCHMARK - 1)
    assert len(envs_module.layouts("pick-place-v3", [5, 6])) == 2 * envs_module.LAYOUTS_PER_BENCHMARK

    class FewerLayouts:
        def __init__(self, task, seed):
            self.train_tasks = real_mt1(task, seed=seed).train_tasks[:49]

    monkeypatch.setattr(envs_module.metaworld, "MT1", FewerLayouts)
    with pytest.raises(RuntimeError, match="drew 49 layouts, not the 50"):
        envs_module.benchmark_tasks("pick-place-v3", 5)
