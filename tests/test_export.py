"""learner.export on the tiny SmolVLA (offline, CPU, on whichever supported lerobot is installed): lerobot's own loaders
read the export strictly, every tensor is the project's, and lerobot's pipeline (its env-observation conversion,
preprocessor, sampler and postprocessor) turns env-unit state and frames into the project's env actions; the refusals;
the command line on a run directory.

Where the two sides meet: both take the same uint8 frames, divide by 255, resize with lerobot's resize_with_pad to the
backbone's image size and map to [-1, 1], so identical frames give identical image inputs. lerobot normalises the
state by (x - mean) / (std + 1e-8) where the project divides by std and clips to +-OBS_CLIP, so the states agree for
states within the clip; lerobot's unnormalised actions are not clipped to [-1, 1] as the project's are (Metaworld
clips them itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from common.config import PolicyConfig, RunConfig
from common.flow import sample_chain, transition
from common.observation import Observation
from common.policy import OBS_CLIP, build_policy, write_directory_atomically
from common.policy.smolvla import SmolVLAFlowPolicy, SmolVLAPolicy
from common.policy.tiny_vlm import TinyVLMSpec, tiny_vlm_dir
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.policy.vla_common import VLAFlowPolicy
from learner.checkpoints import TRAINER_STATE_FILE
from learner.export import main
from learner.run_dir import RUN_CONFIG_FILE, RunDirectory
from tests.test_smolvla import IMAGE_SIZE, tiny_config, tiny_policy
from tests.vla_checks import INSTRUCTIONS
from tests.vla_checks import tiny_observations as observations

install_cpu_torchvision_shim()  # before lerobot's processors import torchvision (a no-op where it is not needed)
from lerobot.envs.utils import preprocess_observation  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_pre_post_processors  # noqa: E402
from lerobot.utils.constants import ACTION, OBS_IMAGES, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE  # noqa: E402

CAMERAS = ["corner", "topview"]
ACTION_DIM = 4
# Padded on both sides: lerobot's sampler integrates the padded action elements, the project's chain holds them at 0.
SMOLVLA = {"max_state_dim": 42, "max_action_dim": 6}
# The backbone's own image size is twice the frames': both sides resize the 32 px frames with padding to 64.
VLM_IMAGE_SIZE = 2 * IMAGE_SIZE
# float32: the project's chain runs t from 0 to 1 and lerobot's from 1 to 0, so the same steps round differently.
ACTION_TOLERANCE = 3e-5  # env units; a chunk sampled with the padded elements free differs by more than 1e-3


def trained_policy(seed: int) -> SmolVLAFlowPolicy:
    """A tiny SmolVLA with two cameras, padded state and actions, a backbone of another image size, and moved_off_init."""
    vlm_path = str(tiny_vlm_dir(TinyVLMSpec(image_size=VLM_IMAGE_SIZE)))
    return moved_off_init(tiny_policy(seed, cameras=CAMERAS, smolvla={**SMOLVLA, "vlm_path": vlm_path}), seed)


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


def save_checkpoint(policy: SmolVLAFlowPolicy, directory: Path) -> Path:
    return write_directory_atomically(directory, policy.save_pretrained)


def export(*argv: str) -> tuple[int, str, str]:
    """learner.export's main on argv -> (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(list(argv))
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[SmolVLAFlowPolicy, Path, Path]:
    """(the policy, its project checkpoint, the lerobot export of that checkpoint)."""
    root = tmp_path_factory.mktemp("export")
    policy = trained_policy(seed=20)
    checkpoint = save_checkpoint(policy, root / "checkpoint")
    status, stdout, stderr = export(str(checkpoint), "--out", str(root / "lerobot"))
    assert status == 0, stderr
    assert "SmolVLAPolicy weights" in stdout and 'get_policy_class("smolvla").from_pretrained(' in stdout
    return policy, checkpoint, root / "lerobot"


def load_lerobot(directory: Path) -> tuple[SmolVLAPolicy, object, object]:
    """As the exporter tells users to: lerobot's policy class by type, strictly, and its processor pipelines."""
    policy = get_policy_class("smolvla").from_pretrained(str(directory), strict=True)
    preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    return policy, preprocessor, postprocessor


def lerobot_observation(obs: Observation, instructions: list[str]) -> dict:
    """The same observation as a gym env hands lerobot: uint8 (B, H, W, 3) frames per camera and env-unit state,
    through lerobot's own env conversion."""
    raw = {"pixels": {camera: obs.images[:, i].numpy() for i, camera in enumerate(CAMERAS)}, "agent_pos": obs.state.numpy()}
    return {**preprocess_observation(raw), "task": instructions}


def within_clip(policy: SmolVLAFlowPolicy, obs: Observation, seed: int) -> Observation:
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


def test_lerobot_reads_every_tensor_and_the_normalisation_of_the_export(exported) -> None:
    policy, _, out = exported
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json", "checksums.json"} <= names
    assert any(n.startswith("policy_preprocessor_") for n in names) and any(n.startswith("policy_postprocessor_") for n in names)
    loaded, preprocessor, postprocessor = load_lerobot(out)
    assert type(loaded) is SmolVLAPolicy

    config = loaded.config
    assert config.vlm_model_name == str(tiny_vlm_dir(TinyVLMSpec(image_size=VLM_IMAGE_SIZE)))
    assert {k: (f.type.name, tuple(f.shape)) for k, f in config.input_features.items()} == {
        OBS_STATE: ("STATE", (39,)),
        **{f"{OBS_IMAGES}.{camera}": ("VISUAL", (3, IMAGE_SIZE, IMAGE_SIZE)) for camera in CAMERAS},
    }
    assert {k: (f.type.name, tuple(f.shape)) for k, f in config.output_features.items()} == {ACTION: ("ACTION", (ACTION_DIM,))}
    assert (config.chunk_size, config.num_steps, config.max_state_dim, config.max_action_dim) == (4, 3, 42, 6)

    check_tensors_are_the_projects(policy, out, loaded)
    check_normaliser_statistics(policy, preprocessor, postprocessor, {"mean": policy.obs_mean, "std": policy.obs_std})


@pytest.mark.parametrize("start", ["zero", "gaussian"])
def test_lerobot_pipeline_gives_the_projects_env_actions(exported, start) -> None:
    """Env-unit state and frames in, env actions out: lerobot's pipeline on the export against the project's chain on
    the same observation and initial noise. "zero" is the project's deterministic (evaluation) policy, a_0 = 0;
    "gaussian" starts both from the same draw, the padded elements of lerobot's included."""
    policy, _, out = exported
    loaded, preprocessor, postprocessor = load_lerobot(out)
    obs = within_clip(policy, observations(policy, 3, seed=21), seed=22)
    batch = preprocessor(lerobot_observation(obs, instructions_of(3)))
    assert torch.equal(batch[OBS_LANGUAGE_TOKENS], obs.tokens) and torch.equal(batch[OBS_LANGUAGE_ATTENTION_MASK], obs.token_mask)
    torch.testing.assert_close(batch[OBS_STATE], policy.normalized_state(obs), atol=1e-6, rtol=0)  # lerobot adds 1e-8 to std
    lerobot_chunk, noise = check_lerobot_chunk_is_the_projects(policy, loaded, postprocessor, obs, batch, start, ACTION_TOLERANCE)
    # select_action serves the same chunk one action at a time.
    loaded.reset()
    torch.testing.assert_close(loaded.select_action(batch, noise=noise), lerobot_chunk[:, 0], atol=1e-6, rtol=0)


def test_states_beyond_the_projects_clip_are_not_clipped_by_lerobot(exported) -> None:
    """Where equality ends: the project clips normalised states to +-OBS_CLIP, lerobot's normaliser does not."""
    policy, _, out = exported
    _, preprocessor, _ = load_lerobot(out)
    obs = observations(policy, 1, seed=24)
    far = dataclasses.replace(obs, state=(policy.obs_mean + 2 * OBS_CLIP * policy.obs_std).unsqueeze(0))
    lerobot_state = preprocessor(lerobot_observation(far, INSTRUCTIONS[:1]))[OBS_STATE]
    torch.testing.assert_close(lerobot_state, torch.full((1, 39), 2.0 * OBS_CLIP), atol=1e-4, rtol=0)
    assert torch.equal(policy.normalized_state(far), torch.full((1, 39), OBS_CLIP))


# -- refusals: one line on stderr, exit status 2, nothing written -------------------------------------------------


def refused(*argv: str) -> str:
    status, stdout, stderr = export(*argv)
    assert status == 2 and stdout == "" and stderr.count("\n") == 1 and stderr.startswith("python -m learner.export: error: ")
    return stderr


def test_an_mlp_checkpoint_has_nothing_to_export(tmp_path) -> None:
    checkpoint = write_directory_atomically(tmp_path / "mlp", build_policy(PolicyConfig()).save_pretrained)
    assert "policy.type 'mlp_flow' policy, which has no lerobot counterpart" in refused(str(checkpoint), "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_and_corrupt_checkpoints_are_refused(exported, tmp_path) -> None:
    _, checkpoint, _ = exported
    assert "does not exist" in refused(str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refused(str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    corrupt = tmp_path / "corrupt"
    save_checkpoint(SmolVLAFlowPolicy.from_pretrained(checkpoint), corrupt)
    weights = bytearray((corrupt / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(weights))
    assert "model.safetensors does not match its sha256" in refused(str(corrupt), "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_existing_out_is_replaced_only_with_overwrite(exported, tmp_path) -> None:
    _, checkpoint, _ = exported
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert f"--out {out} exists: pass --overwrite" in refused(str(checkpoint), "--out", str(out))
    assert (out / "keep.txt").read_text() == "mine"
    assert "holds the checkpoint" in refused(str(checkpoint), "--out", str(checkpoint.parent), "--overwrite")
    status, _, stderr = export(str(checkpoint), "--out", str(out), "--overwrite")
    assert status == 0, stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


# -- the command line on a run directory --------------------------------------------------------------------------


def test_the_command_exports_a_run_directorys_latest_checkpoint(tmp_path) -> None:
    """`python -m learner.export RUN_DIR --out DIR` in a fresh process: the checkpoint `latest` names, not an earlier one."""
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    config = RunConfig(policy=tiny_config(cameras=CAMERAS, smolvla=SMOLVLA))
    (run.path / RUN_CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    policies = {}
    for seed, name in ((30, "iter_000001"), (31, "iter_000002")):
        policies[name] = trained_policy(seed)

        def write(tmp: Path, policy: SmolVLAFlowPolicy = policies[name], name: str = name) -> None:
            policy.save_pretrained(tmp)
            torch.save({"iteration": int(name.removeprefix("iter_"))}, tmp / TRAINER_STATE_FILE)

        write_directory_atomically(run.checkpoints / name, write)
        run.write_latest(name)

    out = tmp_path / "lerobot"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "learner.export", str(run.path), "--out", str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # the summary alone: lerobot's own messages go to stderr
    assert lines[0] == f"wrote a lerobot smolvla checkpoint of {run.checkpoints / 'iter_000002'} to {out}:"
    assert any(line.startswith("  model.safetensors: SmolVLAPolicy weights") for line in lines)
    assert any(line.startswith("  policy_preprocessor.json, ") for line in lines)
    assert any(line.startswith("  checksums.json: ") for line in lines)
    exported_bias = load_file(str(out / "model.safetensors"))["model.action_time_mlp_out.bias"]
    assert torch.equal(exported_bias, policies["iter_000002"].vla.model.action_time_mlp_out.bias)
    assert not torch.equal(exported_bias, policies["iter_000001"].vla.model.action_time_mlp_out.bias)
