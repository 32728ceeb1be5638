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

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import PolicyConfig, RunConfig
from common.flow import sample_chain
from common.metrics import MetricsLog
from common.policy import OBS_CLIP, build_policy, write_directory_atomically
from common.policy.smolvla.model import SmolVLAFlowPolicy, SmolVLAPolicy
from common.policy.smolvla.stand_ins import TinyVLMSpec, tiny_vlm_dir
from common.policy.torchvision_shim import plain_import_fails
from learner.files.checkpoints import TRAINER_STATE_FILE
from learner.files.run_dir import RUN_CONFIG_FILE, RunDirectory
from tests.conftest import REPO
from tests.helpers.lerobot_export import (  # lerobot's names through it: imported after its torchvision shim
    ACTION,
    ACTION_DIM,
    CAMERAS,
    OBS_IMAGES,
    OBS_LANGUAGE_ATTENTION_MASK,
    OBS_LANGUAGE_TOKENS,
    OBS_STATE,
    check_lerobot_chunk_is_the_projects,
    check_normaliser_statistics,
    check_tensors_are_the_projects,
    export,
    get_policy_class,
    instructions_of,
    lerobot_observation,
    make_pre_post_processors,
    moved_off_init,
    noise_of,
    save_checkpoint,
    within_clip,
)
from tests.helpers.vla import IMAGE_SIZE, INSTRUCTIONS, smolvla_config, tiny_observations, tiny_smolvla

# Padded on both sides: lerobot's sampler integrates the padded action elements, the project's chain holds them at 0.
SMOLVLA = {"max_state_dim": 42, "max_action_dim": 6}
# The backbone's own image size is twice the frames': both sides resize the 32 px frames with padding to 64.
VLM_IMAGE_SIZE = 2 * IMAGE_SIZE
# float32: the project's chain runs t from 0 to 1 and lerobot's from 1 to 0, so the same steps round differently.
ACTION_TOLERANCE = 3e-5  # env units; a chunk sampled with the padded elements free differs by more than 1e-3


def trained_policy(seed: int) -> SmolVLAFlowPolicy:
    """A tiny SmolVLA with two cameras, padded state and actions, a backbone of another image size, and moved_off_init."""
    vlm_path = str(tiny_vlm_dir(TinyVLMSpec(image_size=VLM_IMAGE_SIZE)))
    return moved_off_init(tiny_smolvla(seed, cameras=CAMERAS, smolvla={**SMOLVLA, "vlm_path": vlm_path}), seed)


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
    obs = within_clip(policy, tiny_observations(policy, 3, seed=21), seed=22)
    batch = preprocessor(lerobot_observation(obs, instructions_of(3)))
    assert torch.equal(batch[OBS_LANGUAGE_TOKENS], obs.tokens) and torch.equal(batch[OBS_LANGUAGE_ATTENTION_MASK], obs.token_mask)
    torch.testing.assert_close(batch[OBS_STATE], policy.normalized_state(obs), atol=1e-6, rtol=0)  # lerobot adds 1e-8 to std
    lerobot_chunk, noise = check_lerobot_chunk_is_the_projects(policy, loaded, postprocessor, obs, batch, start, ACTION_TOLERANCE)
    # select_action serves the same chunk one action at a time.
    loaded.reset()
    torch.testing.assert_close(loaded.select_action(batch, noise=noise), lerobot_chunk[:, 0], atol=1e-6, rtol=0)


def test_states_beyond_the_projects_clip_are_not_clipped_by_lerobot(exported, monkeypatch) -> None:
    """Where equality ends: the project clips normalised states to +-OBS_CLIP, lerobot's normaliser does not. On such a
    state lerobot's env actions are those of the project's chain on the unclipped state, not the project's own;
    share_beyond_clip (the runs' rollout/state_beyond_clip, which the export reports) counts the states where this
    happens."""
    policy, _, out = exported
    loaded, preprocessor, postprocessor = load_lerobot(out)
    obs = tiny_observations(policy, 1, seed=24)
    far = dataclasses.replace(obs, state=(policy.obs_mean + 20 * OBS_CLIP * policy.obs_std).unsqueeze(0))
    batch = preprocessor(lerobot_observation(far, INSTRUCTIONS[:1]))
    torch.testing.assert_close(batch[OBS_STATE], torch.full((1, 39), 20.0 * OBS_CLIP), atol=1e-3, rtol=0)
    assert torch.equal(policy.normalized_state(far), torch.full((1, 39), OBS_CLIP))

    def env_actions() -> torch.Tensor:  # the project's deterministic chain, unclipped as lerobot's unnormaliser leaves it
        with torch.no_grad():
            chunk = sample_chain(policy, policy.encode(far), 1, deterministic=True).chain[:, -1]
        return chunk * policy.action_std + policy.action_mean

    clipped = env_actions()
    monkeypatch.setattr(policy, "normalized_state", lambda obs: (obs.state - policy.obs_mean) / policy.obs_std)
    unclipped = env_actions()
    with torch.no_grad():
        lerobot_actions = postprocessor(loaded.predict_action_chunk(batch, noise=noise_of(policy, 1, "zero")))
    torch.testing.assert_close(lerobot_actions, unclipped, atol=ACTION_TOLERANCE, rtol=0)
    assert (lerobot_actions - clipped).abs().max() > 2 * ACTION_TOLERANCE  # small in the tiny model, 0.2 in smolvla_base's

    within = within_clip(policy, tiny_observations(policy, 4, seed=25), seed=26).state
    beyond_rows = within[:3].clone()
    for i, sign in enumerate((1.0, -1.0, 1.0)):  # one element just beyond the clip, on either side
        beyond_rows[i, 7 * i] = policy.obs_mean[7 * i] + sign * (OBS_CLIP + 0.01) * policy.obs_std[7 * i]
    states = torch.cat([within, beyond_rows])  # 3 of 7 beyond
    beyond = [bool(((row - policy.obs_mean) / policy.obs_std).abs().max() > OBS_CLIP) for row in states]
    assert policy.share_beyond_clip(states) == pytest.approx(sum(beyond) / len(beyond)) == pytest.approx(3 / 7)


# -- the export on another machine --------------------------------------------------------------------------------

HUB_ID = "flowrl-tests/tiny-smolvlm"  # what the backbone stand-in goes by in the other machine's hub cache

# Run in a fresh interpreter, without the project: a user's own script loading the export with lerobot alone.
LOAD_WITH_LEROBOT_ALONE = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from lerobot.envs.utils import preprocess_observation
from lerobot.policies.factory import get_policy_class, make_pre_post_processors

export, inputs, output, repository = sys.argv[1:5]
policy = get_policy_class("smolvla").from_pretrained(export, strict=True)
preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=export)
tensors = load_file(inputs)
cameras = sorted(key.removeprefix("pixels.") for key in tensors if key.startswith("pixels."))
raw = {"pixels": {camera: tensors[f"pixels.{camera}"].numpy() for camera in cameras}, "agent_pos": tensors["agent_pos"].numpy()}
batch = preprocessor({**preprocess_observation(raw), "task": json.loads(sys.argv[5])})
noise = torch.zeros(len(tensors["agent_pos"]), policy.config.chunk_size, policy.config.max_action_dim)
save_file({"actions": postprocessor(policy.predict_action_chunk(batch, noise=noise)).contiguous()}, output)
project = sorted(name for name, module in sys.modules.items() if (getattr(module, "__file__", None) or "").startswith(repository))
print(json.dumps({"vlm_model_name": policy.config.vlm_model_name, "project_modules": project}))
"""


def hub_cache_holding(directory: Path, hub_id: str, files: Path) -> Path:
    """A Hugging Face hub cache at `directory` holding a snapshot of `hub_id` with the files of `files`, laid out as the
    hub client writes it (what a machine that downloaded the backbone once has)."""
    commit = "0" * 40
    repository = directory / f"models--{hub_id.replace('/', '--')}"
    shutil.copytree(files, repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    return directory


def test_the_export_loads_on_another_machine_by_lerobot_alone_from_the_hub_cache(tmp_path) -> None:
    """Exported with --hub-id, moved to another directory, its checkpoint and the backbone directory it was trained
    with deleted: lerobot alone, in a fresh interpreter with no project module and no network (the backbone in the hub
    cache), loads it and turns env-unit state and frames into the project's env actions. Where plain `import
    torchvision` fails (a CUDA torchvision beside a CPU torch, as the export's note says), lerobot alone cannot
    import at all: that failure is asserted instead (the Python 3.12 stage of CI, whose torch and torchvision match,
    runs the load)."""
    backbone = Path(shutil.copytree(tiny_vlm_dir(TinyVLMSpec(image_size=VLM_IMAGE_SIZE)), tmp_path / "backbone"))
    policy = moved_off_init(tiny_smolvla(40, cameras=CAMERAS, smolvla={**SMOLVLA, "vlm_path": str(backbone)}), 40)
    checkpoint = save_checkpoint(policy, tmp_path / "checkpoint")
    status, stdout, stderr = export(str(checkpoint), "--out", str(tmp_path / "lerobot"), "--hub-id", HUB_ID)
    assert status == 0, stderr
    assert f"SmolVLAConfig: backbone and tokenizer {HUB_ID};" in stdout and "note: the export names" not in stdout
    for name in ("config.json", "policy_preprocessor.json"):
        text = (tmp_path / "lerobot" / name).read_text()
        assert HUB_ID in text and str(backbone) not in text and str(tmp_path) not in text, name

    elsewhere = tmp_path / "another_machine"
    hub = hub_cache_holding(elsewhere / "hub_cache", HUB_ID, backbone)
    shutil.move(tmp_path / "lerobot", elsewhere / "policy")
    shutil.rmtree(backbone)
    shutil.rmtree(checkpoint)

    obs = within_clip(policy, tiny_observations(policy, 3, seed=41), seed=42)
    with torch.no_grad():
        chunk = sample_chain(policy, policy.encode(obs), 3, deterministic=True).chain[:, -1]
    expected = chunk * policy.action_std + policy.action_mean  # lerobot's unnormaliser does not clip to [-1, 1]
    inputs = {f"pixels.{camera}": obs.images[:, i].contiguous() for i, camera in enumerate(CAMERAS)} | {"agent_pos": obs.state}
    save_file(inputs, str(elsewhere / "inputs.safetensors"))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HOME", "XDG_CACHE_HOME")}
    env |= {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [str(elsewhere / "policy"), str(elsewhere / "inputs.safetensors"), str(elsewhere / "actions.safetensors"), str(REPO)]
    done = subprocess.run([sys.executable, "-c", LOAD_WITH_LEROBOT_ALONE, *argv, json.dumps(instructions_of(3))],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    if plain_import_fails():
        assert done.returncode != 0 and "operator torchvision::nms does not exist" in done.stderr, done.stderr[-2000:]
        return
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"vlm_model_name": HUB_ID, "project_modules": []}
    actions = load_file(str(elsewhere / "actions.safetensors"))["actions"]
    assert actions.shape == (3, policy.chunk_size, ACTION_DIM) and expected.std() > 0.1
    torch.testing.assert_close(actions, expected, atol=ACTION_TOLERANCE, rtol=0)


def test_without_a_hub_id_the_export_names_this_machines_directory_and_says_so(exported, tmp_path) -> None:
    """The tiny backbone has no hub id: the export names its directory here, with a note; a bad --hub-id is refused."""
    _, checkpoint, _ = exported
    status, stdout, stderr = export(str(checkpoint), "--out", str(tmp_path / "out"))
    assert status == 0, stderr
    backbone = tiny_vlm_dir(TinyVLMSpec(image_size=VLM_IMAGE_SIZE))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vlm_model_name"] == str(backbone)
    (note,) = [line for line in stdout.splitlines() if line.startswith("note: the export names")]
    assert note == (f"note: the export names {backbone} (this machine's) for the files it does not hold, so it loads only where "
                    "that directory exists; give their hub id with --hub-id to load it anywhere")  # fmt: skip
    assert "--hub-id must be a hub id as owner/name" in refused(str(checkpoint), "--out", str(tmp_path / "b"), "--hub-id", "/a/path")
    assert not (tmp_path / "b").exists()


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
    config = RunConfig(policy=smolvla_config(cameras=CAMERAS, smolvla=SMOLVLA))
    (run.path / RUN_CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    policies = {}
    for seed, name in ((30, "iter_000001"), (31, "iter_000002")):
        policies[name] = trained_policy(seed)

        def write(tmp: Path, policy: SmolVLAFlowPolicy = policies[name], name: str = name) -> None:
            policy.save_pretrained(tmp)
            torch.save({"iteration": int(name.removeprefix("iter_"))}, tmp / TRAINER_STATE_FILE)

        write_directory_atomically(run.checkpoints / name, write)
        run.write_latest(name)

    MetricsLog(run.path / "metrics.jsonl").write({"iteration": 1, "rollout/state_beyond_clip": 0.5})
    for iteration, share in ((2, 0.125), (3, 0.75)):  # iteration 3 comes after the checkpoint exported
        MetricsLog(run.path / "metrics.jsonl").write({"iteration": iteration, "rollout/state_beyond_clip": share})
    out = tmp_path / "lerobot"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "learner.export", str(run.path), "--out", str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # the summary alone: lerobot's own messages go to stderr
    assert lines[0] == f"wrote a lerobot smolvla checkpoint of {run.checkpoints / 'iter_000002'} to {out}:"
    assert any(line.startswith("  model.safetensors: SmolVLAPolicy weights") for line in lines)
    assert any(line.startswith("  policy_preprocessor.json, ") for line in lines)
    assert any(line.startswith("  checksums.json: ") for line in lines)
    assert (
        "note: lerobot's normaliser does not clip the state as the policy does (at +-5 std of its mean): in iterations "
        "1-2 of the run, 31.2% of the decisions met a state beyond it, where lerobot's actions differ from the policy's"
    ) in lines
    # torchvision imported as a user's own interpreter does, without the project: the export says when that fails here.
    plain = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True, timeout=120)
    noted = [line for line in lines if line.startswith("note: lerobot alone cannot import on this machine: torchvision ")]
    assert len(noted) == (plain.returncode != 0), (plain.stderr[-500:], lines)
    assert all("install the torchvision built for that torch" in line for line in noted)
    exported_bias = load_file(str(out / "model.safetensors"))["model.action_time_mlp_out.bias"]
    assert torch.equal(exported_bias, policies["iter_000002"].vla.model.action_time_mlp_out.bias)
    assert not torch.equal(exported_bias, policies["iter_000001"].vla.model.action_time_mlp_out.bias)
