"""A lerobot checkpoint in lerobot's Metaworld layout in and out of the project, on the tiny SmolVLA (offline, CPU, either
lerobot line): as init_checkpoint it starts a run as it is (every tensor of its model, its normaliser's statistics
unfloored) but for the padded action elements lerobot-train trains action_in_proj on, which the run's start holds at
zero; the project's evaluation from lerobot's start (policy.eval_init_noise_std 1.0) is then lerobot's own sampler on
the checkpoint with those columns held, its noise drawn on every padded element; and the suite's scripted
demonstrations written as a LeRobotDataset read back, through lerobot's own API, as the frames, states and actions the
env gave. On PushT, whose env acts in pixels, lerobot's side speaks the env's units and the policy its [-1, 1]."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from common.config_loading import load_config
from common.demonstrations import collect_demonstrations
from common.flow import sample_chain, transition
from common.lerobot_dataset import dataset_features, lerobot_dataset_class, read_demonstrations, write_demonstrations
from common.observation import Observation
from common.policy import FlowPolicy, build_policy
from common.policy.lerobot_compat import pad_vector
from common.policy.vla_common import hold_padded_actions
from common.suites import ImageConfig, make_suite
from learner.bc.starting_checkpoint import lerobot_start_checkpoint
from learner.bc.training import pretrain
from tests.conftest import REPO
from tests.helpers.lerobot_export import get_policy_class, make_pre_post_processors, preprocess_observation

TINY = ["policy.type=smolvla", "policy.image_size=32", "policy.chunk_size=4", "policy.num_steps=3", "policy.hidden_dim=32",
        "policy.smolvla.num_vlm_layers=2", "policy.init_noise_std=1.0", "policy.eval_init_noise_std=1.0"]  # fmt: skip


IN_PROJ = "model.action_in_proj.weight"


def lerobot_batch(obs: Observation, sentence: str) -> dict:
    """The observation as lerobot's Metaworld env hands it to a policy (one frame under `pixels`, agent_pos), through
    lerobot's own conversion."""
    raw = {"pixels": obs.images[:, 0].numpy(), "agent_pos": obs.state.numpy().astype(np.float64)}
    return {**preprocess_observation(raw), "task": [sentence] * obs.state.shape[0]}


def test_a_lerobot_checkpoint_starts_a_run_as_it_is_and_lerobot_samples_the_policy_the_project_evaluates(tmp_path):
    source_config = load_config(overrides=["env.observations=lerobot", *TINY])
    assert source_config.policy.image_keys == ["observation.image"] and source_config.policy.obs_dim == 4
    torch.manual_seed(0)
    source = build_policy(source_config.policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    # a state element spread below the project's floor (OBS_STD_FLOOR): lerobot's model read it normalised by that spread
    source.set_normalization(torch.tensor([0.0, 0.6, 0.2, 0.5]), torch.tensor([0.1, 0.08, 0.01, 0.4]), torch.tensor([0.1, -0.2, 0.0, 0.3]),
                             torch.full((4,), 0.5), exact=True)  # fmt: skip
    export = tmp_path / "pretrained_model"
    source.to_lerobot(export)
    # as lerobot-train leaves them: action_in_proj trained on the padded elements too, which lerobot draws noise for
    weights = load_file(str(export / "model.safetensors"))
    padded_columns = weights[IN_PROJ][:, 4:]
    padded_columns.copy_(0.2 * torch.randn(padded_columns.shape, generator=generator))
    save_file(weights, str(export / "model.safetensors"))

    run = load_config(overrides=[f"init_checkpoint={export}", *TINY[3:]])
    assert (run.env.observations, run.policy.type, run.policy.cameras, run.policy.image_size) == ("lerobot", "smolvla", ["corner4"], 32)
    policy = FlowPolicy.from_pretrained(lerobot_start_checkpoint(run))
    assert lerobot_start_checkpoint(run) == lerobot_start_checkpoint(run)  # built once, then the cached one
    file = load_file(str(export / "model.safetensors"))
    model = policy.vla.state_dict()
    assert len(file) == len(model) and all(torch.equal(model[name], tensor) for name, tensor in file.items() if name != IN_PROJ)
    assert torch.equal(model[IN_PROJ][:, :4], file[IN_PROJ][:, :4]) and not model[IN_PROJ][:, 4:].any()  # the padded ones held
    torch.testing.assert_close(policy.obs_std, torch.tensor([0.1, 0.08, 0.01, 0.4]) + 1e-8, rtol=0, atol=1e-7)  # lerobot's std + eps
    torch.testing.assert_close(policy.action_mean, source.action_mean, rtol=0, atol=0)

    # the project's deterministic evaluation from lerobot's start, and lerobot's sampler from that start
    suite = make_suite(run.env)
    env = suite.make_env("pick-place-v3", [ImageConfig(32, 32, "corner4")])
    state, _ = env.reset()
    frames = env.render_cameras()
    env.close()
    sentence = suite.instruction("pick-place-v3")
    tokens, mask = policy.tokenize([sentence] * 2)
    obs = Observation(torch.from_numpy(np.stack([state, state + 0.01])), torch.from_numpy(np.stack([frames, frames])),
                      torch.from_numpy(tokens), torch.from_numpy(mask))  # fmt: skip
    with torch.no_grad():
        features = policy.encode(obs)
        chain = sample_chain(policy, features, 2, deterministic=True, generator=torch.Generator().manual_seed(5)).chain
        start = torch.randn((2, policy.chunk_size, policy.action_dim), generator=torch.Generator().manual_seed(5))
        assert torch.equal(chain[:, 0], start)  # a_0 drawn (eval_init_noise_std 1), then no injected noise:
        for k in range(policy.num_steps):
            torch.testing.assert_close(chain[:, k + 1], transition(policy, features, chain[:, k], k)[0], rtol=0, atol=0)
    # lerobot's own sampler on the checkpoint, its start drawn on every padded element as lerobot draws it: as trained, the
    # padded elements steer its chain elsewhere; with their columns held, as the run's start holds them, it is the run's
    loaded = get_policy_class("smolvla").from_pretrained(str(export))
    loaded.eval()
    preprocessor, postprocessor = make_pre_post_processors(loaded.config, pretrained_path=str(export))
    padded_noise = torch.randn((2, policy.chunk_size, loaded.config.max_action_dim - 4), generator=generator)
    noise = torch.cat([start, padded_noise], dim=-1)
    batch = preprocessor(lerobot_batch(obs, sentence))
    project = chain[:, -1] * policy.action_std + policy.action_mean
    with torch.no_grad():
        as_trained = postprocessor(loaded.predict_action_chunk(batch, noise=noise.clone()))
        assert hold_padded_actions(loaded, 4) == loaded.config.max_action_dim - 4
        actions = postprocessor(loaded.predict_action_chunk(batch, noise=noise.clone()))
    assert (as_trained - project).abs().max() > 1e-2
    torch.testing.assert_close(actions, project, atol=1e-5, rtol=0)
    assert actions.std() > 0.05


def test_demonstrations_written_as_a_lerobot_dataset_are_read_back_by_lerobot_as_the_env_gave_them(tmp_path):
    config = load_config(overrides=["env.observations=lerobot", "policy.type=smolvla", "policy.image_size=48", "env.max_episode_steps=60"])
    out = tmp_path / "dataset"
    written = write_demonstrations(config, out, episodes=2)
    assert written["episodes"] == 2 and written["features"] == ["action", "observation.image", "observation.state"]
    dataset = lerobot_dataset_class()("flowrl/metaworld", root=out)
    assert dataset.meta.fps == 80 and dataset.meta.robot_type == "sawyer" and dataset.num_episodes == 2
    assert list(dataset.meta.tasks.index) == ["Pick and place a puck to a goal"]
    row = dataset[3]  # lerobot's own reading: channels first, in [0, 1]
    assert row["observation.image"].shape == (3, 48, 48) and row["observation.state"].shape == (4,)
    assert row["task"] == "Pick and place a puck to a goal"

    suite = make_suite(config.env)
    obs, actions, sentences, episodes = read_demonstrations(out, config.policy, suite)
    assert obs.images.shape == (len(actions), 1, 48, 48, 3) and obs.images.dtype == np.uint8
    assert sentences == ["Pick and place a puck to a goal"] * len(actions)
    np.testing.assert_array_equal((row["observation.image"] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy(), obs.images[3, 0])
    # replayed in the env from the first demonstration layout, the actions give the states and frames the dataset holds
    env = suite.make_env("pick-place-v3", [ImageConfig(48, 48, "corner4", fast=False)], suite.layouts("pick-place-v3", [0])[0])
    state, _ = env.reset()
    first = [i for i, episode in enumerate(episodes) if episode == 0]
    try:
        for i in first:
            np.testing.assert_array_equal(state, obs.state[i])
            np.testing.assert_array_equal(env.render_cameras()[0], obs.images[i, 0])
            state, *_ = env.step(actions[i])
    finally:
        env.close()
    assert make_suite(config.env).config.fast_render is False  # lerobot's observations draw as lerobot does

    # the same dataset as the project's behaviour-cloning source: every row, its sentence's tokens
    cloned = load_config(overrides=["env.observations=lerobot", *TINY[:-2], "policy.image_size=48", f"pretrain.dataset={out}",
                                    "pretrain.train_steps=3", "pretrain.batch_size=8", "pretrain.eval_episodes=0"])  # fmt: skip
    report = pretrain(cloned, tmp_path / "bc", progress=False)
    assert (report["demos"], report["samples"], report["demo_success_rate"]) == (2, written["frames"], None)
    assert FlowPolicy.from_pretrained(tmp_path / "bc").config.image_keys == ["observation.image"]


def test_a_pusht_policy_speaks_pixels_to_lerobot_and_a_lerobot_pusht_checkpoint_starts_in_the_policys_units(tmp_path):
    """PushT in lerobot's observations: the export's postprocessor turns the chain into the env's 0-512 pixels (lerobot's
    units), the very actions the suite steps the env with for the policy's [-1, 1] ones; read back as init_checkpoint, its
    action statistics return to the policy's units."""
    overrides = ["env.observations=lerobot", *TINY[:-2]]
    source_config = load_config(REPO / "configs" / "pusht.yaml", overrides)
    assert source_config.policy.action_bounds == [0.0, 0.0, 512.0, 512.0] and source_config.policy.image_keys == ["observation.image"]
    torch.manual_seed(0)
    source = build_policy(source_config.policy)
    source.set_normalization(torch.tensor([250.0, 260.0]), torch.tensor([120.0, 110.0]), torch.tensor([0.1, -0.2]),
                             torch.tensor([0.5, 0.4]), exact=True)  # fmt: skip
    export = tmp_path / "pretrained_model"
    source.to_lerobot(export)

    suite = make_suite(source_config.env)
    task = suite.tasks()[0]
    env = suite.make_env(task, [ImageConfig(32, 32, "pixels")])
    state, _ = env.reset()
    frames = env.render_cameras()
    tokens, mask = source.tokenize([suite.instruction(task)] * 2)
    obs = Observation(torch.from_numpy(np.stack([state, state + 5.0])), torch.from_numpy(np.stack([frames, frames])),
                      torch.from_numpy(tokens), torch.from_numpy(mask))  # fmt: skip
    with torch.no_grad():
        chain = sample_chain(source, source.encode(obs), 2, deterministic=True).chain
    actions = (chain[:, -1] * source.action_std + source.action_mean).clamp(-1.0, 1.0).numpy()
    low, high = np.asarray(source_config.policy.action_bounds[:2]), np.asarray(source_config.policy.action_bounds[2:])
    pixels = low + (actions.astype(np.float64) + 1.0) * 0.5 * (high - low)  # what the suite steps the env with
    env.close()

    loaded = get_policy_class("smolvla").from_pretrained(str(export))
    loaded.eval()
    preprocessor, postprocessor = make_pre_post_processors(loaded.config, pretrained_path=str(export))
    raw = {"pixels": obs.images[:, 0].numpy(), "agent_pos": obs.state.numpy().astype(np.float64)}
    batch = {**preprocess_observation(raw), "task": [suite.instruction(task)] * 2}
    start = pad_vector(chain[:, 0], loaded.config.max_action_dim)
    with torch.no_grad():
        theirs = postprocessor(loaded.predict_action_chunk(preprocessor(batch), noise=start))
    assert 0 < pixels.min() and pixels.max() < 512, "inside the env's bounds, where neither side clips"
    np.testing.assert_allclose(theirs.numpy(), pixels, atol=2e-3, rtol=0)

    run = load_config(REPO / "configs" / "pusht.yaml", [f"init_checkpoint={export}", *TINY[3:-2]])
    assert (run.env.observations, run.policy.action_bounds, run.policy.obs_dim) == ("lerobot", [0.0, 0.0, 512.0, 512.0], 2)
    started = FlowPolicy.from_pretrained(lerobot_start_checkpoint(run))
    torch.testing.assert_close(started.action_mean, source.action_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(started.action_std, source.action_std, atol=1e-6, rtol=0)


def test_a_lerobot_pusht_dataset_is_read_in_the_policys_action_units(tmp_path):
    """A LeRobotDataset of PushT in lerobot's layout, written by lerobot's own API with its actions in pixels (as
    lerobot's PushT datasets hold them): behaviour cloning reads them in the policy's [-1, 1] units."""
    config = load_config(REPO / "configs" / "pusht.yaml", ["env.observations=lerobot", *TINY[:-2]])
    out = tmp_path / "pusht"
    dataset = lerobot_dataset_class().create(repo_id="flowrl/pusht", fps=10, features=dataset_features(config.policy), root=out,
                                             use_videos=False)  # fmt: skip
    pixels = np.array([[384.0, 51.2], [0.0, 512.0], [256.0, 128.0]], dtype=np.float32)
    frame = np.zeros((32, 32, 3), dtype=np.uint8)
    for action in pixels:
        dataset.add_frame({"observation.image": frame, "observation.state": np.array([200.0, 300.0], dtype=np.float32),
                           "action": action, "task": ""})  # fmt: skip
    dataset.save_episode()
    dataset.finalize()
    obs, actions, sentences, _ = read_demonstrations(out, config.policy, make_suite(config.env))
    np.testing.assert_allclose(actions, [[0.5, -0.8], [-1.0, 1.0], [0.0, -0.5]], atol=1e-6, rtol=0)
    assert sentences == [""] * 3 and obs.state.shape == (3, 2)


def test_a_dataset_of_successful_demonstrations_skips_the_layouts_where_the_expert_fails(tmp_path):
    """push-back's expert, with the demonstrations' noise, fails on layout 5 of benchmark seed 0: six successful
    demonstrations are layouts 0-4 and 6, every one a success."""
    config = load_config(overrides=["env.task=push-back-v3", "pretrain.successful_demos_only=true"])
    written = write_demonstrations(config, tmp_path / "dataset", episodes=6)
    assert (written["episodes"], written["successes"]) == (6, 6)
    dataset = lerobot_dataset_class()("flowrl/metaworld", root=tmp_path / "dataset")
    assert dataset.num_episodes == 6 and dataset.num_frames == written["frames"]
    suite = make_suite(config.env)
    episodes = collect_demonstrations(suite, "push-back-v3", suite.layouts("push-back-v3", [0])[:7], 0.1, 0)
    lengths = [len(episode.actions) for episode in episodes]
    assert lengths[5] == config.env.max_episode_steps and written["frames"] == sum(lengths) - lengths[5]
