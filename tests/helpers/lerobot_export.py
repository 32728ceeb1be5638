"""The two sides of a lerobot export, for tests/integration/test_export*.py: the project's policy moved off its
initialisation and saved, the export command, and lerobot's loaded policy and pipeline checked against the project's
tensors, statistics and chains."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from common.flow import sample_chain, transition
from common.observation import Observation
from common.policy import write_directory_atomically
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.policy.vla_common import VLAFlowPolicy
from learner.export import main
from tests.helpers.vla import INSTRUCTIONS

install_cpu_torchvision_shim()  # before lerobot's processors import torchvision (a no-op where it is not needed)
from lerobot.envs.utils import preprocess_observation  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_pre_post_processors  # noqa: E402, F401  (for the tests, after the shim)
from lerobot.utils.constants import ACTION, OBS_IMAGES, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE  # noqa: E402, F401

CAMERAS = ["corner", "topview"]
ACTION_DIM = 4


def moved_off_init(policy: VLAFlowPolicy, seed: int) -> VLAFlowPolicy:
    """`policy` with per-element normalisation and every weight moved off its initialisation (a tensor lerobot left at
    init would show)."""
    generator = torch.Generator().manual_seed(seed)
    policy.set_normalization(
        0.5 * torch.randn(39, generator=generator),
        0.1 + torch.rand(39, generator=generator),
        0.2 * torch.randn(ACTION_DIM, generator=generator),
        0.2 + 0.5 * torch.rand(ACTION_DIM, generator=generator),
    )
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return policy


def save_checkpoint(policy: VLAFlowPolicy, directory: Path) -> Path:
    return write_directory_atomically(directory, policy.save_pretrained)


def export(*argv: str) -> tuple[int, str, str]:
    """learner.export's main on argv -> (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(list(argv))
    return status, stdout.getvalue(), stderr.getvalue()


def lerobot_observation(obs: Observation, instructions: list[str]) -> dict:
    """The same observation as a gym env hands lerobot: uint8 (B, H, W, 3) frames per camera and env-unit state,
    through lerobot's own env conversion."""
    raw = {"pixels": {camera: obs.images[:, i].numpy() for i, camera in enumerate(CAMERAS)}, "agent_pos": obs.state.numpy()}
    return {**preprocess_observation(raw), "task": instructions}


def within_clip(policy: VLAFlowPolicy, obs: Observation, seed: int) -> Observation:
    """obs with env-unit states within 3 std of the mean (normalised, inside the project's +-OBS_CLIP)."""
    uniform = torch.rand(obs.state.shape, generator=torch.Generator().manual_seed(seed))
    return dataclasses.replace(obs, state=policy.obs_mean + policy.obs_std * (6.0 * uniform - 3.0))


def check_tensors_are_the_projects(policy: VLAFlowPolicy, out: Path, loaded: torch.nn.Module) -> None:
    """The exported file holds lerobot's model alone (no noise head, critic or project buffers), and the model lerobot
    loaded is tensor by tensor the project's, bar action_in_proj's columns for the padded action elements, which are 0
    (lerobot_sampling_copy)."""
    ours, theirs = policy.vla.state_dict(), loaded.state_dict()
    assert set(load_file(str(out / "model.safetensors"))) <= set(ours)
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        expected = tensor.clone()
        if name == "model.action_in_proj.weight":
            assert expected[:, policy.action_dim :].abs().max() > 0  # trained, so zeroing them is a change
            expected[:, policy.action_dim :] = 0.0
        assert torch.equal(theirs[name], expected), name


def check_normaliser_statistics(policy: VLAFlowPolicy, preprocessor, postprocessor, state: dict[str, torch.Tensor]) -> None:
    """lerobot's normaliser and unnormaliser hold the project's action mean and std exactly, and the normaliser `state`
    ({statistic: tensor}) for the state."""
    (normalizer,) = [step for step in preprocessor.steps if type(step).__name__ == "NormalizerProcessorStep"]
    (unnormalizer,) = [step for step in postprocessor.steps if type(step).__name__ == "UnnormalizerProcessorStep"]
    for step in (normalizer, unnormalizer):
        stats = step.state_dict()
        assert torch.equal(stats[f"{ACTION}.mean"], policy.action_mean) and torch.equal(stats[f"{ACTION}.std"], policy.action_std)
    assert {key for key in normalizer.state_dict() if key.startswith(f"{OBS_STATE}.")} == {f"{OBS_STATE}.{name}" for name in state}
    for name, expected in state.items():
        assert torch.equal(normalizer.state_dict()[f"{OBS_STATE}.{name}"], expected), name


def instructions_of(batch_size: int) -> list[str]:
    """The instructions tiny_observations tokenizes, in turn."""
    return [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch_size)]


def noise_of(policy: VLAFlowPolicy, batch_size: int, start: str) -> Tensor:
    """lerobot's initial noise over every padded action element: "zero" (the project's deterministic policy, a_0 = 0)
    or a Gaussian draw."""
    shape = (batch_size, policy.chunk_size, policy.settings.max_action_dim)
    return torch.zeros(shape) if start == "zero" else torch.randn(shape, generator=torch.Generator().manual_seed(23))


def check_lerobot_chunk_is_the_projects(
    policy: VLAFlowPolicy, loaded, postprocessor, obs: Observation, batch: dict, start: str, tolerance: float
) -> tuple[Tensor, Tensor]:
    """lerobot's sampler on its preprocessed `batch`, then its postprocessor, from noise_of(start), give the project's
    chain on `obs` from the same start (its first action_dim) mapped to env units, within `tolerance` -> (lerobot's
    normalised chunk, the noise it started from)."""
    noise = noise_of(policy, obs.state.shape[0], start)
    with torch.no_grad():
        features = policy.encode(obs)
        if start == "zero":
            chunk = sample_chain(policy, features, obs.state.shape[0], deterministic=True).chain[:, -1]
        else:
            chunk = noise[..., : policy.action_dim]
            for k in range(policy.num_steps):
                chunk, _ = transition(policy, features, chunk, k)
        # For contrast: the same weights without lerobot_sampling_copy follow another chain in lerobot's sampler.
        unneutralised = policy.vla.model.sample_actions(*policy.lerobot_inputs(obs), noise=noise.clone())[..., : policy.action_dim]
    assert (unneutralised - chunk).abs().max() > 10 * tolerance

    lerobot_chunk = loaded.predict_action_chunk(batch, noise=noise.clone())
    env_actions = postprocessor(lerobot_chunk)
    assert env_actions.shape == (obs.state.shape[0], policy.chunk_size, policy.action_dim)
    unclipped = chunk * policy.action_std + policy.action_mean
    assert unclipped.std() > 0.1  # a real chunk, not constants on both sides
    torch.testing.assert_close(env_actions, unclipped, atol=tolerance, rtol=0)
    torch.testing.assert_close(env_actions.clamp(-1.0, 1.0), policy.to_env_action(chunk), atol=tolerance, rtol=0)
    return lerobot_chunk, noise
