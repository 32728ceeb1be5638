"""Demonstrations as a LeRobotDataset, written and read with lerobot's own dataset API, so that the same files train
lerobot's policies (lerobot-train) and the project's behaviour cloning (pretrain.dataset).

A dataset holds what the run's policy observes (env.observations): each camera's frame under its lerobot key
(policy.image_features(): lerobot's Metaworld layout is one observation.image), observation.state as the policy reads
it, the executed action, and each episode's task sentence. Frames are stored as images (PNG), not video: what a policy
trains on is then exactly what the env drew. One episode per demonstration layout (env.demo_benchmark_seed; with
pretrain.successful_demos_only, per layout on which the expert succeeds), written as it ends, so a dataset of
480-pixel frames never sits in memory whole. Actions are in the env's units, as lerobot's policies act
(policy.action_bounds; the policy's own are in [-1, 1]).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, PolicyConfig, RunConfig
from common.demonstrations import Episode, demonstration_episodes, successful_episodes
from common.observation import Observation
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.suites import ImageConfig, Suite, make_suite

STATE_KEY, ACTION_KEY = "observation.state", "action"
INSTALL = "a LeRobotDataset is written and read with lerobot's own API: install the smolvla or lerobot extra (docs/smolvla.md)"


def lerobot_dataset_class() -> type:
    """lerobot's LeRobotDataset (its import after the project's torchvision guard); a ConfigError without lerobot."""
    install_cpu_torchvision_shim()
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as exc:
        raise ConfigError(f"{INSTALL} ({exc})") from None
    return LeRobotDataset


def dataset_features(policy: PolicyConfig) -> dict[str, dict[str, Any]]:
    """lerobot's feature table for what `policy` observes and does: its frames, state and action."""
    side = policy.image_size
    frames = {key: {"dtype": "image", "shape": (side, side, 3), "names": ["height", "width", "channel"]} for key in policy.image_features()}
    return {
        **(frames if side > 0 else {}),
        STATE_KEY: {"dtype": "float32", "shape": (policy.obs_dim,), "names": None},
        ACTION_KEY: {"dtype": "float32", "shape": (policy.action_dim,), "names": None},
    }


def write_demonstrations(
    config: RunConfig, out: Path, episodes: int, overwrite: bool = False, progress: Callable[[str, Episode], None] | None = None
) -> dict[str, Any]:
    """`episodes` scripted demonstrations of each of the run's tasks, on the first layouts of env.demo_benchmark_seed,
    with pretrain.demo_noise and pretrain.seed as behaviour cloning draws them (the first that succeed with
    pretrain.successful_demos_only), into a new LeRobotDataset at `out` (repo id flowrl/<suite>). Returns what was
    written. A ConfigError before anything is written when `out` exists (unless `overwrite`), the suite has no expert or
    fewer layouts, or lerobot is missing. The dataset is written beside `out` and put in its place once whole: a
    failed or stopped write (too few successes too) leaves `out` as it was."""
    suite, policy = make_suite(config.env), config.policy
    tasks = suite.tasks()
    if episodes < 1 or episodes > suite.layouts_per_seed:
        raise ConfigError(f"--episodes must be in [1, {suite.layouts_per_seed}] (the layouts of env.demo_benchmark_seed), got {episodes}")
    missing = [task for task in tasks if suite.expert(task) is None]
    if missing:
        raise ConfigError(f"{suite.name} has no scripted expert for {missing}: no demonstrations to write")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists: choose another directory, or pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory: --overwrite replaces a dataset directory only")
    dataset_class = lerobot_dataset_class()
    # Written beside `out` and swapped in whole: a write that fails or is stopped leaves `out` as it was.
    tmp, old = (out.with_name(f".{out.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    cameras = [ImageConfig(policy.image_size, policy.image_size, camera) for camera in policy.cameras] if policy.image_size else []
    centre, half_width = policy.action_units()  # lerobot's: the env's units
    fps = suite.lerobot_fps or 30
    written = {"episodes": 0, "frames": 0, "successes": 0}
    try:
        dataset = dataset_class.create(
            repo_id=f"flowrl/{suite.name}",
            fps=fps,
            features=dataset_features(policy),
            root=tmp,
            robot_type=suite.lerobot_robot or None,
            use_videos=False,
        )
        for task in tasks:
            layouts, noise, seed = suite.layouts(task, [config.env.demo_benchmark_seed]), config.pretrain.demo_noise, config.pretrain.seed
            sentence = suite.instruction(task)
            recorded = (
                successful_episodes(suite, task, layouts, episodes, noise, seed, cameras)
                if config.pretrain.successful_demos_only
                else demonstration_episodes(suite, task, layouts[:episodes], noise, seed, cameras)
            )
            for episode in recorded:
                for t in range(len(episode.actions)):
                    action = (episode.actions[t] * half_width + centre).astype(np.float32)
                    frame = {STATE_KEY: episode.observations[t], ACTION_KEY: action, "task": sentence}
                    for c, key in enumerate(policy.image_features() if cameras else []):
                        frame[key] = episode.frames[t, c]
                    dataset.add_frame(frame)
                dataset.save_episode()
                written["episodes"] += 1
                written["frames"] += len(episode.actions)
                written["successes"] += int(episode.success)
                if progress is not None:
                    progress(task, episode)
        dataset.finalize()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return {**written, "fps": fps, "features": sorted(dataset_features(policy)), "tasks": tasks}


def check_dataset(directory: Path, policy: PolicyConfig, suite: Suite) -> None:
    """A ConfigError naming the file and the fix unless `directory` is a LeRobotDataset on this machine that holds what
    `policy` reads (its keys, widths and frame size) for the run's tasks, read from its meta/ files alone: before any
    work starts, and before lerobot, which would look for a directory it cannot read on the model hub."""
    what = f"pretrain.dataset {directory}"
    if not directory.exists():
        raise ConfigError(
            f"{what} does not exist: give the directory `python -m learner.dataset --out` or lerobot wrote (a local "
            "path; datasets are never downloaded)"
        )
    info_file = directory / "meta" / "info.json"
    if not directory.is_dir() or not info_file.is_file():
        kind = "is a file" if not directory.is_dir() else "is empty" if not any(directory.iterdir()) else "has no meta/info.json"
        raise ConfigError(f"{what} {kind}, not a LeRobotDataset directory: give the directory `python -m learner.dataset --out` wrote")
    import pandas  # ray[tune]'s, as pyarrow
    from pyarrow import ArrowException

    try:
        info = json.loads(info_file.read_text())
        features, episodes, data_path = info["features"], int(info["total_episodes"]), str(info["data_path"])
        tasks = set(pandas.read_parquet(directory / "meta" / "tasks.parquet").index)
    except (OSError, ValueError, KeyError, TypeError, ArrowException) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(
            f"{what}: its meta/ files are corrupt or incomplete ({type(exc).__name__}: {exc}): write the dataset again"
        ) from None
    for key, feature in dataset_features(policy).items():
        found = features.get(key)
        shape = None if not isinstance(found, dict) else tuple(found.get("shape", ()))
        if shape != tuple(feature["shape"]):
            raise ConfigError(
                f"{what}: {key} is {shape or 'missing'}, the policy reads {tuple(feature['shape'])} (its features: {sorted(features)})"
            )
    sentences = {suite.instruction(task) for task in suite.tasks()}
    if tasks - sentences:
        raise ConfigError(
            f"{what} holds the tasks {sorted(tasks - sentences)}, which are not the run's {sorted(sentences)} (env.task, env.observations)"
        )
    first_file = directory / data_path.format(chunk_index=0, file_index=0)
    if episodes < 1 or not first_file.is_file():
        raise ConfigError(
            f"{what} holds no episodes ({'total_episodes 0' if episodes < 1 else f'{first_file} is missing'}): write the dataset again"
        )


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """lerobot's dataset API with every request to the model hub refused, as a ConfigError: a dataset is read from its
    directory alone (lerobot fetches what it does not find there)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    except OfflineModeIsEnabled as exc:
        raise ConfigError(
            f"lerobot found the dataset incomplete and asked the model hub for the rest, which a run never does ({exc})"
        ) from None
    finally:
        constants.HF_HUB_OFFLINE = offline


def read_demonstrations(directory: Path, policy: PolicyConfig, suite: Suite) -> tuple[Observation, np.ndarray, list[str], list[int]]:
    """A LeRobotDataset's frames as behaviour cloning reads them: the observations (frames under the policy's keys,
    uint8; the state), the (M, A) actions, each row's task sentence, and each row's episode. A ConfigError naming the
    feature when the dataset does not hold what the policy reads (check_dataset), and one when lerobot cannot read
    it from its directory."""
    check_dataset(directory, policy, suite)
    dataset_class = lerobot_dataset_class()
    try:
        with hub_offline():
            dataset = dataset_class("flowrl/local", root=directory)
    except ConfigError as exc:
        raise ConfigError(f"pretrain.dataset {directory}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - lerobot's own errors for a dataset it cannot read, as one line
        raise ConfigError(
            f"pretrain.dataset {directory}: lerobot cannot read it ({type(exc).__name__}: {exc}): write the dataset again"
        ) from None
    rows = dataset.hf_dataset.with_format(None)
    tasks = list(dataset.meta.tasks.index)
    task_sentences = [tasks[index] for index in rows["task_index"]]
    image_keys = policy.image_features() if policy.image_size else []
    images = None
    if image_keys:
        images = np.stack([np.stack([np.asarray(row[key].convert("RGB")) for key in image_keys]) for row in rows])
    state = np.asarray(rows[STATE_KEY], dtype=np.float32)
    centre, half_width = policy.action_units()
    actions = (np.asarray(rows[ACTION_KEY], dtype=np.float32) - centre) / half_width
    return Observation(state, images), actions, task_sentences, list(rows["episode_index"])
