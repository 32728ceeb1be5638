"""What a lerobot policy checkpoint tells a run before any model is built, read from its files alone (no torch, no
lerobot): the frames and state its config.json's input_features name, its architecture and backbone, and the statistics
its preprocessor normalises with.

A run meets a lerobot checkpoint in two places. `init_checkpoint` may be one (lerobot-train's
checkpoints/<step>/pretrained_model): the run fine-tunes it as it is, without behaviour cloning. policy.<section>.
lerobot_checkpoint may be one (a base model such as smolvla_base): its weights initialise the model that behaviour
cloning then trains. Either way the run's observations, cameras, frame size and architecture follow the checkpoint
where the config does not set them (with_checkpoint_features), and what no layout gives is refused in one line that
says how to map it (check_features).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.config import ConfigError, RunConfig
from common.policy.registry import BACKENDS

if TYPE_CHECKING:
    from common.suites import Suite

LEROBOT_CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "policy_preprocessor.json"
NORMALIZER_STEP = "normalizer_processor"
EMPTY_CAMERA = "observation.images.empty_camera_"  # the frames lerobot's SmolVLA pads in for --policy.empty_cameras
# lerobot's config fields that the project's policy config holds too: (lerobot's name, the project's dotted field below
# policy, or below policy.<section> where it starts with a dot).
ARCHITECTURE_FIELDS = (
    ("chunk_size", "chunk_size"),
    ("max_state_dim", ".max_state_dim"),
    ("max_action_dim", ".max_action_dim"),
    ("tokenizer_max_length", ".tokenizer_max_length"),
    ("num_vlm_layers", ".num_vlm_layers"),
    ("num_expert_layers", ".num_expert_layers"),
    ("self_attn_every_n_layers", ".self_attn_every_n_layers"),
    ("expert_width_multiplier", ".expert_width_multiplier"),
)


@dataclass(frozen=True)
class LerobotFeatures:
    """A lerobot checkpoint's config.json, as far as a run reads it."""

    directory: Path
    field: str  # the config field that named it (init_checkpoint, policy.smolvla.lerobot_checkpoint)
    type: str  # lerobot's policy type (smolvla, pi0, pi05)
    images: dict[str, tuple[int, ...]]  # each visual input's key -> its (C, H, W), in the file's order
    state: int | None  # observation.state's width, None without one
    action: int | None
    fields: dict[str, Any]  # the whole config.json


def is_lerobot_checkpoint(directory: str | Path) -> bool:
    """A directory whose config.json is a lerobot policy config (it names input_features), not the project's."""
    path = Path(directory).expanduser() / LEROBOT_CONFIG_FILE
    try:
        return path.is_file() and "input_features" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def starting_checkpoint(config: RunConfig) -> tuple[str, Path] | None:
    """(the field, the directory) of the lerobot checkpoint the run starts from: init_checkpoint where it is one, else
    policy.<section>.lerobot_checkpoint; None when neither names one."""
    if config.init_checkpoint and is_lerobot_checkpoint(config.init_checkpoint):
        return "init_checkpoint", Path(config.init_checkpoint).expanduser()
    section = config.policy.vla_section()
    named = getattr(config.policy, section).lerobot_checkpoint if section else ""
    if named and (Path(named).expanduser() / LEROBOT_CONFIG_FILE).is_file():
        return f"policy.{section}.lerobot_checkpoint", Path(named).expanduser()
    return None


def read_features(field: str, directory: Path) -> LerobotFeatures:
    """The checkpoint's features; a ConfigError naming `field` when its config.json cannot be read as lerobot's."""
    path = directory / LEROBOT_CONFIG_FILE
    try:
        fields = json.loads(path.read_text())
        features = fields["input_features"]
        images = {key: tuple(int(n) for n in value["shape"]) for key, value in features.items() if value["type"] == "VISUAL"}
        state = features.get("observation.state", {}).get("shape", [None])[0]
        action = fields.get("output_features", {}).get("action", {}).get("shape", [None])[0]
        kind = str(fields["type"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{field}: {path} is not a lerobot policy config with readable input_features ({exc!r})") from None
    return LerobotFeatures(directory, field, kind, images, state, action, fields)


def frame_side(features: LerobotFeatures) -> int:
    """The one square frame size every visual input has (policy.image_size); a ConfigError otherwise."""
    shapes = set(features.images.values())
    sides = {shape[1] for shape in shapes if len(shape) == 3 and shape[0] == 3 and shape[1] == shape[2]}
    if len(shapes) != 1 or len(sides) != 1:
        raise ConfigError(
            f"{features.field}: the frames {features.images} are not one square RGB size (3, S, S), which policy.image_size "
            "is for every camera"
        )
    return sides.pop()


def layout_gives(suite: Suite, task: str, features: LerobotFeatures, rename_map: Mapping[str, str]) -> bool:
    """Every frame of the checkpoint is one the suite's lerobot observations give (after rename_map), and its state is
    theirs."""
    keys = {rename_map.get(key, key) for key in suite.lerobot_images}
    return bool(suite.lerobot_images) and set(features.images) <= keys and features.state == suite.lerobot_state_size


def cameras_for(
    features: LerobotFeatures, sources: dict[str, str], rename_map: Mapping[str, str], observations: str, suite_name: str
) -> list[str]:
    """The scene camera of each of the checkpoint's frames, in its order: the one the env key it is renamed from is drawn
    from. A ConfigError naming the frame and the rename_map that would give it where none does."""
    env_key = {rename_map.get(key, key): key for key in sources}
    cameras = []
    for key in features.images:
        if key.startswith(EMPTY_CAMERA) and key not in env_key:
            raise ConfigError(
                f"{features.field} reads {key}, a camera lerobot fills with a blank frame (--policy.empty_cameras), "
                "which the project's policies do not: train it without empty cameras, or map an env frame to "
                "each"
            )
        if key not in env_key:
            offered = ", ".join(sources)
            example = next(iter(sources), "observation.images.<camera>")
            raise ConfigError(
                f"{features.field} reads {key}, which env.observations {observations!r} of {suite_name} does not give "
                f"(it gives {offered}): map one to it, e.g. --set 'policy.rename_map={{{example}: {key}}}'"
            )
        cameras.append(sources[env_key[key]])
    return cameras


def with_checkpoint_features(config: RunConfig, given: set[str]) -> RunConfig:
    """`config` with what the run's starting lerobot checkpoint (starting_checkpoint) fixes, where `given` (the dotted
    fields a file or override set) leaves it: policy.type, env.observations ("auto": "lerobot" when the suite's lerobot
    observations give every frame and the state the checkpoint reads, else "project"), the cameras, their keys and frame
    size, and the architecture; a SmolVLA checkpoint's backbone directory as policy.smolvla.vlm_path when it names a
    local one; and, starting from init_checkpoint, the checkpoint itself as policy.<section>.lerobot_checkpoint (it holds
    every tensor). Without a checkpoint "auto" is left as it is (it reads as "project"), and the cameras and keys are the
    layout's (lerobot's observations fix them) after policy.rename_map. With lerobot's observations, their episode
    limit."""
    from common.suites import make_suite  # a suite's module imports its simulator

    if config.policy.type not in BACKENDS:
        return config  # validation names it
    start = starting_checkpoint(config)
    features = None if start is None else read_features(*start)
    env, policy = config.env, config.policy
    if features is not None and "policy.type" not in given and features.type in BACKENDS:
        policy = dataclasses.replace(policy, type=features.type)
    section = policy.vla_section()
    try:
        suite = make_suite(dataclasses.replace(env, observations="project") if env.observations == "auto" else env)
        task = suite.tasks()[0]
        if env.observations == "auto" and features is not None:  # without a checkpoint "auto" stays, read as "project"
            lerobot = section is not None and layout_gives(suite, task, features, policy.rename_map)
            env = dataclasses.replace(env, observations="lerobot" if lerobot else "project")
            suite = make_suite(env)
        sources = suite.image_sources(task)
        limit = min(suite.lerobot_episode_limit(name) for name in suite.tasks()) if env.lerobot_observations else 0
    except ValueError:  # ConfigError included: an env section the suite refuses is left for the run's checks to name
        return dataclasses.replace(config, env=env, policy=policy)
    policy_fields: dict[str, Any] = {}
    section_fields: dict[str, Any] = {}
    if features is not None and section is not None:
        if features.images:
            cameras = cameras_for(features, sources, policy.rename_map, env.observations, suite.name)  # refuses a frame none gives
            if "policy.cameras" not in given:
                policy_fields["cameras"] = cameras
            if "policy.image_keys" not in given:
                policy_fields["image_keys"] = list(features.images)
            if "policy.image_size" not in given:
                policy_fields["image_size"] = frame_side(features)
        settings = getattr(policy, section)
        for lerobot_name, name in ARCHITECTURE_FIELDS:
            if lerobot_name not in features.fields:
                continue
            if not name.startswith("."):
                if f"policy.{name}" not in given:
                    policy_fields[name] = features.fields[lerobot_name]
            elif f"policy.{section}{name}" not in given and hasattr(settings, name[1:]):
                section_fields[name[1:]] = features.fields[lerobot_name]
        backbone = features.fields.get("vlm_model_name", "")
        if section == "smolvla" and not settings.vlm_path and backbone and (Path(backbone).expanduser() / "config.json").is_file():
            section_fields["vlm_path"] = backbone
        if start[0] == "init_checkpoint":
            section_fields["lerobot_checkpoint"] = str(features.directory)
    elif (policy.image_size > 0 or policy.vla_section()) and (env.lerobot_observations or policy.rename_map):
        if env.lerobot_observations:
            if "policy.cameras" not in given:
                policy_fields["cameras"] = list(sources.values())
            if "policy.image_size" not in given and suite.lerobot_frame_size:
                policy_fields["image_size"] = suite.lerobot_frame_size
        if "policy.image_keys" not in given:
            by_camera = {camera: policy.rename_map.get(key, key) for key, camera in sources.items()}
            cameras = policy_fields.get("cameras", policy.cameras)
            policy_fields["image_keys"] = [by_camera.get(camera, f"observation.images.{camera}") for camera in cameras]
    if limit and "env.max_episode_steps" not in given:
        env = dataclasses.replace(env, max_episode_steps=limit)
    if section_fields:
        policy_fields[section] = dataclasses.replace(getattr(policy, section), **section_fields)
    return dataclasses.replace(config, env=env, policy=dataclasses.replace(policy, **policy_fields))


def check_features(config: RunConfig, suite: Suite) -> None:
    """The run's starting lerobot checkpoint reads the frames the run's policy gets (policy.image_features(), from the
    cameras the suite gives them from) and a state of the run's width, unless its projection is learnt anew
    (reinit_state_proj) or it has none (a state written into the prompt); a ConfigError naming the field and the fix
    otherwise. Reads the JSON only."""
    start = starting_checkpoint(config)
    section = config.policy.vla_section()
    if start is None or section is None:
        return
    features, policy = read_features(*start), config.policy
    if features.type != policy.type:
        raise ConfigError(
            f"{features.field}: {features.directory} is a lerobot {features.type!r} checkpoint, not policy.type {policy.type!r}"
        )
    if list(features.images) != policy.image_features():
        raise ConfigError(
            f"{features.field} reads the frames {list(features.images)} (its input_features) but the policy is given "
            f"{policy.image_features()} (policy.cameras {policy.cameras}): leave policy.cameras and policy.image_keys "
            "unset, or map the env's keys with policy.rename_map"
        )
    suite.check_image_keys(policy, suite.tasks()[0])
    if BACKENDS[policy.type].state_in_prompt:
        return  # a state written into the prompt as bins has no width a projection fixes (pi0.5)
    if features.state != policy.obs_dim and not getattr(policy, section).reinit_state_proj:
        layout = (
            ""
            if config.env.lerobot_observations or not suite.lerobot_images
            else (f"; env.observations 'lerobot' gives {suite.lerobot_state_size}")
        )
        raise ConfigError(
            f"{features.field} reads a {features.state}-element observation.state but the run's state has {policy.obs_dim} "
            f"(policy.obs_dim, env.observations {config.env.observations!r}{layout}): set "
            f"policy.{section}.reinit_state_proj: "
            "true to learn a new state projection"
        )


def normalisation(directory: Path) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """The (mean, std) the checkpoint's preprocessor normalises observation.state and action with, std with lerobot's
    eps added (its normaliser divides by std + eps), or None when it has no normaliser step (a base checkpoint). A
    CheckpointError when it normalises them otherwise than by mean and std, which is all the project's policies do."""
    from safetensors.numpy import load_file

    from common.storage import CheckpointError

    path = directory / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    steps = [step for step in json.loads(path.read_text()).get("steps", []) if step.get("registry_name") == NORMALIZER_STEP]
    if not steps or "state_file" not in steps[0]:
        return None
    step = steps[0]
    modes = step.get("config", {}).get("norm_map", {})
    for kind in ("STATE", "ACTION"):
        if modes.get(kind, "MEAN_STD") != "MEAN_STD":
            raise CheckpointError(
                f"{path}: lerobot normalises {kind} by {modes[kind]}; the project's policies read state and actions "
                "normalised by mean and std (train with --policy.normalization_mapping's MEAN_STD)"
            )
    stats = load_file(str(directory / step["state_file"]))
    eps = float(step.get("config", {}).get("eps", 1e-8))
    found = {}
    for key in ("observation.state", "action"):
        if f"{key}.mean" not in stats or f"{key}.std" not in stats:
            raise CheckpointError(
                f"{directory / step['state_file']} has no {key}.mean and {key}.std: the project needs both to read lerobot's units"
            )
        found[key] = (stats[f"{key}.mean"].astype(np.float32), (stats[f"{key}.std"] + eps).astype(np.float32))
    return found
