"""Behaviour cloning of a flow policy: demonstrations (a suite's scripted expert, with action noise, or a LeRobotDataset)
cut into (observation, chunk) pairs, the velocity field trained on them with the conditional flow-matching loss, and the
checkpoint (safetensors, config, normalisation statistics as buffers) scored deterministically on held-out layouts.
One trainer for every backend; `python -m learner.pretrain` runs it alone, learner.bc.starting_checkpoint caches it."""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from common.config import ConfigError, PretrainConfig, RunConfig
from common.demonstrations import Episode, FailedDemonstrationWarning, collect_demonstrations, successful_episodes
from common.lerobot_dataset import read_demonstrations
from common.metrics import success_interval
from common.observation import Observation
from common.policy import FlowPolicy, build_policy, write_directory_atomically
from common.rollout import camera_configs, close_and_free, evaluate_layouts, make_envs, task_positions
from common.suites import make_suite
from common.suites.base import Layout, Suite

REPORT_FILE = "pretrain.json"
# Bump when the BC recipe or the policy's parameter layout changes, so cached checkpoints are rebuilt.
RECIPE_VERSION = 3


def chunk_dataset(episodes: list[Episode], chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(obs_t, actions[t : t + H]) for every step t; chunks running past the episode end repeat its
    last action (the policy learns to hold still once done). Returns (M, obs_dim), (M, H, A)."""
    observations, chunks = [], []
    for episode in episodes:
        length = len(episode.actions)
        index = np.minimum(np.arange(length)[:, None] + np.arange(chunk_size)[None, :], length - 1)
        observations.append(episode.observations)
        chunks.append(episode.actions[index])
    return np.concatenate(observations).astype(np.float32), np.concatenate(chunks).astype(np.float32)


def flow_matching_loss(policy: FlowPolicy, obs: Observation, chunks: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Conditional flow matching on the straight path a_t = (1 - t) a_0 + t a_1, a_0 ~ N(0, I):
    the velocity at a_t should be a_1 - a_0. Time runs 0 (noise) -> 1 (action) as in common.flow.
    obs: a batch of B observations (torch); chunks (B, H, A) in env units."""
    target = policy.normalize_action(chunks)
    noise = torch.randn(target.shape, generator=generator).to(target.device)  # drawn on the CPU: the same draws on any device
    t = torch.rand(len(chunks), generator=generator).to(target.device)
    a_t = (1.0 - t[:, None, None]) * noise + t[:, None, None] * target
    return ((policy.velocity(a_t, t, policy.encode(obs)) - (target - noise)) ** 2).mean()


def demonstration_dataset(
    episodes: list[Episode], chunk_size: int, instructions: dict[str, tuple[np.ndarray, np.ndarray]] | None
) -> tuple[Observation, np.ndarray]:
    """chunk_dataset as a numpy Observation of M rows, with each step's camera frames (when the episodes were
    rendered) and its episode's task's instruction tokens (instructions: task -> ids (1, L) and mask (1, L); None for
    a policy that reads no language), and the (M, H, A) chunks."""
    states, chunks = chunk_dataset(episodes, chunk_size)
    frames = None if episodes[0].frames is None else np.concatenate([episode.frames for episode in episodes])
    ids = mask = None
    if instructions is not None:
        rows = [instructions[episode.layout.task] for episode in episodes]
        ids, mask = (np.concatenate([np.repeat(row[k], len(e.actions), axis=0) for row, e in zip(rows, episodes)]) for k in (0, 1))
    return Observation(states, frames, ids, mask), chunks


def check_task_demos(cfg: PretrainConfig, tasks: list[str]) -> None:
    """pretrain.task_demos may name only the run's tasks (a typo would otherwise be ignored)."""
    unknown = sorted(set(cfg.task_demos) - set(tasks))
    if unknown:
        raise ConfigError(f"pretrain.task_demos names {unknown}, not among the run's tasks {tasks}")


def demo_counts(cfg: PretrainConfig, tasks: list[str]) -> dict[str, int]:
    """How many demonstrations of each task BC trains on: pretrain.task_demos where it names the task, else
    pretrain.num_demos."""
    check_task_demos(cfg, tasks)
    return {task: cfg.task_demos.get(task, cfg.num_demos) for task in tasks}


def dataset_demonstrations(config: RunConfig, suite: Suite, policy: FlowPolicy) -> tuple[Observation, Tensor, list[Episode]]:
    """pretrain.dataset's episodes as demonstrations() gives the expert's: each step's observation (frames, state, its
    episode's sentence tokenized by the policy) and the chunk from it, and the episodes (their success unknown)."""
    obs, actions, sentences, episode_of = read_demonstrations(Path(config.pretrain.dataset).expanduser(), config.policy, suite)
    by_task = {suite.instruction(task): task for task in suite.tasks()}
    episodes = []
    for index in dict.fromkeys(episode_of):
        rows = np.flatnonzero(np.asarray(episode_of) == index)
        frames = None if obs.images is None else obs.images[rows]
        episodes.append(Episode(obs.state[rows], actions[rows], False, Layout(by_task[sentences[rows[0]]], -1, int(index)), frames))
    tokens = policy.tokenize(sentences)
    dataset = Observation(obs.state, obs.images, *(None if tokens is None else tokens))
    return dataset, torch.from_numpy(chunk_dataset(episodes, config.policy.chunk_size)[1]), episodes


def demonstrations(config: RunConfig, suite: Suite, policy: FlowPolicy, cameras: list) -> tuple[Observation, Tensor, list[Episode]]:
    """pretrain.num_demos scripted episodes of each of the run's tasks, as the policy reads them (camera frames from
    `cameras`, each task's instruction tokenized by the policy): the dataset's observations, the (M, H, A) chunks
    in env units, and the episodes. With pretrain.dataset, that dataset's episodes instead (dataset_demonstrations)."""
    if config.pretrain.dataset:
        return dataset_demonstrations(config, suite, policy)
    return expert_demonstrations(config, suite, policy, cameras, demo_counts(config.pretrain, suite.tasks()))


def expert_demonstrations(
    config: RunConfig, suite: Suite, policy: FlowPolicy, cameras: list, counts: dict[str, int], warn_failed: Collection[str] | None = None
) -> tuple[Observation, Tensor, list[Episode]]:
    """counts[task] scripted episodes of each task named (the first layouts of env.demo_benchmark_seed, with
    pretrain.demo_noise; the first that succeed with pretrain.successful_demos_only), as demonstrations() gives them.
    Failed episodes among them are named in a FailedDemonstrationWarning, for the tasks in `warn_failed` only where it
    is given (a caller collecting tasks again whose failures it has named already)."""
    cfg, tasks = config.pretrain, list(counts)
    episodes = []
    for task in tasks:
        demo_layouts = suite.layouts(task, [config.env.demo_benchmark_seed])
        if cfg.successful_demos_only:
            episodes += successful_episodes(suite, task, demo_layouts, counts[task], cfg.demo_noise, cfg.seed, cameras)
            continue
        task_episodes = collect_demonstrations(suite, task, demo_layouts[: counts[task]], cfg.demo_noise, cfg.seed, cameras)
        failed = [episode.layout.index for episode in task_episodes if not episode.success]
        if failed and (warn_failed is None or task in warn_failed):
            message = (
                f"{task}: {len(failed)} of its {len(task_episodes)} scripted demonstrations did not succeed (layouts {failed} "
                f"of benchmark seed {config.env.demo_benchmark_seed}) and are cloned as they are; "
                "pretrain.successful_demos_only: true keeps the ones that succeed"
            )
            warnings.warn(message, FailedDemonstrationWarning, stacklevel=2)
        episodes += task_episodes
    tokens = policy.tokenize([suite.instruction(task) for task in tasks])  # one call: every row padded alike
    by_task = None if tokens is None else {task: (tokens[0][[i]], tokens[1][[i]]) for i, task in enumerate(tasks)}
    obs, chunks = demonstration_dataset(episodes, config.policy.chunk_size, by_task)
    return obs, torch.from_numpy(chunks), episodes


def fit_flow_matching(policy: FlowPolicy, obs: Observation, chunks: Tensor, cfg: PretrainConfig, progress: bool) -> list[float]:
    """Behaviour cloning: the policy's normalisation from the dataset, then cfg.train_steps AdamW steps of the
    flow-matching loss on the backend's behaviour_cloning_parameters(). Returns every step's loss."""
    states, flat_actions = torch.from_numpy(obs.state), chunks.reshape(-1, chunks.shape[-1])
    policy.set_normalization(states.mean(0), states.std(0), flat_actions.mean(0), flat_actions.std(0))
    optimizer = torch.optim.AdamW(policy.behaviour_cloning_parameters(), lr=cfg.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.train_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    losses = []
    policy.train()
    bar = tqdm(range(cfg.train_steps), desc="bc flow-matching", disable=not progress, mininterval=1.0)
    for step in bar:
        index = torch.randint(len(chunks), (min(cfg.batch_size, len(chunks)),), generator=generator)
        loss = flow_matching_loss(policy, obs.index(index).to_torch(policy.obs_device), chunks[index], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.4f}")
    policy.eval()
    return losses


def evaluate_by_task(policy: FlowPolicy, suite: Suite, layouts: list[Layout], cameras: list) -> np.ndarray:
    """Deterministic success (bool, one per layout) of the policy on held-out layouts, ten envs of a task at a time."""
    successes = np.zeros(len(layouts), dtype=bool)
    for task, positions in task_positions(layouts).items():
        envs = make_envs(suite, [task] * 10, cameras)
        try:
            successes[positions] = evaluate_layouts(policy, envs, [layouts[i] for i in positions])
        finally:  # a task's envs go before the next task's come: a LIBERO env holds hundreds of megabytes
            close_and_free(envs)
    return successes


def pretrain(config: RunConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Collect demonstrations, train, evaluate, and save a checkpoint to out_dir (written atomically).

    One trainer for every backend: the demonstrations carry what the policy reads (camera frames from
    policy.cameras, rendered at every step, and the task's instruction, tokenized once by the policy), and the
    flow-matching loss trains the backend's `behaviour_cloning_parameters()`. The noise head and critic get no
    gradient here; RL trains them.
    """
    cfg, env_cfg = config.pretrain, config.env
    suite = make_suite(env_cfg)
    tasks = suite.tasks()
    if not cfg.dataset and None in demo_counts(cfg, tasks).values():
        raise ValueError("pretrain() needs pretrain.num_demos; ensure_bc_checkpoint chooses it per task when it is null")
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    policy = build_policy(config.policy)
    cameras = camera_configs(policy.config)
    obs, chunks, episodes = demonstrations(config, suite, policy, cameras)
    demo_seconds = time.perf_counter() - start
    losses = fit_flow_matching(policy, obs, chunks, cfg, progress)
    train_seconds = time.perf_counter() - start - demo_seconds
    eval_layouts = suite.held_out(cfg.eval_episodes)
    successes = evaluate_by_task(policy, suite, eval_layouts, cameras)

    rate, low, high = success_interval(successes)
    report = {
        "demos": len(episodes),
        "demo_success_rate": None if cfg.dataset else float(np.mean([e.success for e in episodes])),
        "samples": len(chunks),
        "loss_first_100": float(np.mean(losses[:100])),
        "loss_last_100": float(np.mean(losses[-100:])),
        "eval_episodes": len(successes),
        "eval_success_rate": rate,
        "eval_success_95ci": [low, high],
        "eval_layouts": f"{env_cfg.task} benchmark seeds {env_cfg.eval_benchmark_seeds}, first {len(successes) // len(tasks)}"
        + (f" of each of {len(tasks)} tasks" if len(tasks) > 1 else ""),
        "seconds": {"demos": demo_seconds, "train": train_seconds, "total": time.perf_counter() - start},
        "config": {"policy": dataclasses.asdict(config.policy), "env": dataclasses.asdict(env_cfg), "pretrain": dataclasses.asdict(cfg)},
    }
    if cameras:
        report["frames"] = f"{len(cameras)} camera(s) {policy.config.cameras}, {policy.config.image_size}x{policy.config.image_size} uint8"
    if obs.tokens is not None:
        report["instruction"] = suite.instruction(tasks[0]) if len(tasks) == 1 else {task: suite.instruction(task) for task in tasks}
    if len(tasks) > 1:
        report["demos_per_task"] = demo_counts(cfg, tasks)
        report["per_task"] = {task: success_interval(successes[positions]) for task, positions in task_positions(eval_layouts).items()}

    def write(directory: Path) -> None:
        policy.save_pretrained(directory)
        (directory / REPORT_FILE).write_text(json.dumps(report, indent=2))

    write_directory_atomically(out_dir, write)
    return report
