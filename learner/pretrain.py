"""Behaviour-cloning pre-training of the flow policy from a suite's scripted demonstrations (Metaworld's experts).

    python -m learner.pretrain --out checkpoints/bc            # defaults from common.config.PretrainConfig
    python -m learner.pretrain --set pretrain.num_demos=7 --out /tmp/bc7

RL fine-tuning starts from a pre-trained policy, and no weights are downloaded at run time, so the project
makes its own: the scripted expert is rolled out (with action noise) on `pretrain.num_demos` layouts of
`env.demo_benchmark_seed`, the velocity field is trained with the conditional flow-matching loss, and the
checkpoint (safetensors + config + normalisation statistics as buffers) is evaluated deterministically
on held-out layouts. The starting policy is deliberately weak, to leave room for RL: by default
(`pretrain.num_demos: null`) the number of demonstrations is chosen per task so that held-out success lands
in [pretrain.target_success_min, target_success_max] (ensure_bc_checkpoint; every candidate is cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from common.config import ConfigError, PretrainConfig, RunConfig, cache_dir
from common.config_loading import load_config
from common.demonstrations import Episode, collect_demonstrations
from common.file_digests import file_sha256
from common.lerobot_checkpoint import PREPROCESSOR_FILE
from common.lerobot_checkpoint import normalisation as lerobot_normalisation
from common.lerobot_dataset import read_demonstrations
from common.metrics import success_interval
from common.observation import Observation
from common.policy import WEIGHTS_FILE, CheckpointError, FlowPolicy, build_policy, write_directory_atomically
from common.rollout import camera_configs, evaluate_layouts, make_envs, task_positions
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
    noise = torch.randn(target.shape, generator=generator)
    t = torch.rand(len(chunks), generator=generator)
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
    cfg, tasks = config.pretrain, suite.tasks()
    counts = demo_counts(cfg, tasks)
    episodes = []
    for task in tasks:
        demo_layouts = suite.layouts(task, [config.env.demo_benchmark_seed])[: counts[task]]
        episodes += collect_demonstrations(suite, task, demo_layouts, cfg.demo_noise, cfg.seed, cameras)
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
        successes[positions] = evaluate_layouts(policy, make_envs(suite, [task] * 10, cameras), [layouts[i] for i in positions])
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


def bc_cache_key(config: RunConfig) -> str:
    """The checkpoint depends on the policy's architecture, the task's episode rules and the pre-training
    recipe; not on the sampling fields (noise bounds, K, ...), which the RL run sets on load, nor on the
    success window that only chooses among demonstration counts, nor on how the RL run deals its envs to the tasks."""
    if config.pretrain.num_demos is None and not config.pretrain.dataset:
        raise ValueError("bc_cache_key needs a resolved pretrain.num_demos (see ensure_bc_checkpoint)")
    relevant = {name: dataclasses.asdict(getattr(config, name)) for name in ("policy", "env", "pretrain")}
    if config.pretrain.dataset:  # what it holds, not where: the demonstration counts do not apply
        root = Path(config.pretrain.dataset).expanduser()
        files = sorted(path for folder in ("meta", "data") for path in (root / folder).rglob("*") if path.is_file())
        relevant["pretrain"]["dataset"] = {str(path.relative_to(root)): file_sha256(path) for path in files}
        for name in ("num_demos", "task_demos"):
            del relevant["pretrain"][name]
    for name in config.policy.SAMPLING_FIELDS:
        del relevant["policy"][name]
    for name in ("target_success_min", "target_success_max"):
        del relevant["pretrain"][name]
    for name in ("task_weights", "solved_task_weight"):
        del relevant["env"][name]
    # Fields at the values that behave as before they existed keep the key it was: cached checkpoints stay valid.
    if not relevant["pretrain"].get("task_demos", True):
        del relevant["pretrain"]["task_demos"]
    if not relevant["pretrain"]["dataset"]:
        del relevant["pretrain"]["dataset"]
    for section, name, unchanged in (("env", "observations", ("auto", "project")), ("env", "render", ("auto", "fast")),
                                     ("policy", "image_keys", ([],)), ("policy", "rename_map", ({},))):  # fmt: skip
        if relevant[section][name] in unchanged:
            del relevant[section][name]
    relevant["recipe_version"] = RECIPE_VERSION
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


# Demonstration counts tried when pretrain.num_demos is null: start at 5 (pick-place's calibrated count), then
# more demonstrations while the BC policy is below the window, fewer while it is above. Each candidate is cached.
DEMO_LADDER_UP = (5, 7, 10, 15, 20, 30, 50)
DEMO_LADDER_DOWN = (3, 2, 1)


# A multi-task run's counts for each task, fewest first: every candidate retrains the one policy on all tasks, so
# counts only rise, and the fewest that reaches the window leaves that task the most room for RL.
TASK_DEMO_LADDER = tuple(sorted(DEMO_LADDER_DOWN + DEMO_LADDER_UP))


def with_demo_counts(config: RunConfig, counts: dict[str, int]) -> RunConfig:
    """config with every task's demonstration count resolved, in one form per set of counts (so one cache entry):
    num_demos the fewest, task_demos the tasks that get more."""
    fewest = min(counts.values())
    task_demos = {task: count for task, count in counts.items() if count != fewest}
    return dataclasses.replace(config, pretrain=dataclasses.replace(config.pretrain, num_demos=fewest, task_demos=task_demos))


def describe_counts(cfg: PretrainConfig) -> str:
    if cfg.dataset:
        return f"the LeRobotDataset {cfg.dataset}"
    extra = ", ".join(f"{task} {count}" for task, count in cfg.task_demos.items())
    return f"{cfg.num_demos} demos" + (f" ({extra})" if extra else "")


def cached_bc_checkpoint(config: RunConfig) -> tuple[Path, dict]:
    """The cached checkpoint for this exact config (num_demos resolved), built on first use; with its report."""
    path = cache_dir("bc") / bc_cache_key(config)
    if not (path / REPORT_FILE).is_file():
        print(f"[pretrain] {config.env.task}, {describe_counts(config.pretrain)}: building {path} (once; about a minute)", flush=True)
        report = pretrain(config, path)
        print(f"[pretrain] done: held-out success {report['eval_success_rate']:.2f} in {report['seconds']['total']:.0f}s", flush=True)
    return path, json.loads((path / REPORT_FILE).read_text())


def ensure_bc_checkpoint(config: RunConfig) -> Path:
    """The BC checkpoint to fine-tune, created on first use (so the main job is one command).

    Every task that pretrain.num_demos null leaves without a count (pretrain.task_demos gives some) gets one chosen
    from held-out success: search_demo_count for a single-task run, search_task_demos for a multi-task one."""
    if config.pretrain.dataset:
        return cached_bc_checkpoint(config)[0]
    tasks = make_suite(config.env).tasks()
    counts = demo_counts(config.pretrain, tasks)
    searched = [task for task, count in counts.items() if count is None]
    if not searched:
        return cached_bc_checkpoint(with_demo_counts(config, counts))[0]
    if len(tasks) == 1:
        return search_demo_count(config)
    return search_task_demos(config, counts, searched)


def lerobot_start_checkpoint(config: RunConfig) -> Path:
    """The policy a run fine-tunes from a lerobot checkpoint named by init_checkpoint (lerobot-train's pretrained_model),
    as it is, without behaviour cloning: lerobot's model with every tensor of the file (policy.<section>.lerobot_checkpoint
    is that directory, common.lerobot_checkpoint), the state and action normalisation of its preprocessor, and the
    project's noise head and critic drawn from pretrain.seed. Cached by the checkpoint's files and the policy config, so
    the learner and every actor load the same one."""
    source = Path(config.init_checkpoint).expanduser()
    relevant = dataclasses.asdict(config.policy)
    for name in config.policy.SAMPLING_FIELDS:
        del relevant[name]
    files = sorted(path for path in source.iterdir() if path.suffix in (".json", ".safetensors"))
    relevant |= {"seed": config.pretrain.seed, "recipe_version": RECIPE_VERSION, "files": {path.name: file_sha256(path) for path in files}}
    path = cache_dir("lerobot_start") / hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
    if (path / WEIGHTS_FILE).is_file():
        return path
    stats = lerobot_normalisation(source)
    if stats is None:
        raise CheckpointError(f"init_checkpoint {source} has no normaliser in its {PREPROCESSOR_FILE} (a base model, not a trained "
                              f"policy): name it as policy.{config.policy.vla_section()}.lerobot_checkpoint, whose weights behaviour "
                              "cloning starts from, and leave init_checkpoint unset")  # fmt: skip
    torch.manual_seed(config.pretrain.seed)
    policy = build_policy(config.policy)
    (state_mean, state_std), (action_mean, action_std) = stats["observation.state"], stats["action"]
    if state_mean.shape != (config.policy.obs_dim,) or action_mean.shape != (config.policy.action_dim,):
        raise CheckpointError(f"{source}: its normaliser's state {state_mean.shape} and action {action_mean.shape} statistics are not the "
                              f"policy's ({config.policy.obs_dim},) and ({config.policy.action_dim},)")  # fmt: skip
    policy.set_normalization(*(torch.from_numpy(array) for array in (state_mean, state_std, action_mean, action_std)), exact=True)
    print(f"[start] fine-tuning the lerobot checkpoint {source} as it is (its model and normalisation; the noise head and "
          f"critic drawn from pretrain.seed {config.pretrain.seed}): {path}", flush=True)  # fmt: skip
    return write_directory_atomically(path, policy.save_pretrained)


def search_demo_count(config: RunConfig) -> Path:
    """A single task's count: tried along the ladders until the held-out success is inside [target_success_min,
    target_success_max]; a task that never lands there gets the closest candidate and a warning that says so."""
    cfg = config.pretrain
    low, high = cfg.target_success_min, cfg.target_success_max
    tried: dict[int, tuple[Path, float]] = {}
    ladder = DEMO_LADDER_UP
    index = 0
    while index < len(ladder):
        count = ladder[index]
        path, report = cached_bc_checkpoint(dataclasses.replace(config, pretrain=dataclasses.replace(cfg, num_demos=count)))
        rate = report["eval_success_rate"]
        tried[count] = (path, rate)
        if low <= rate <= high:
            if len(tried) > 1:
                print(f"[pretrain] {config.env.task}: {count} demos give held-out success {rate:.2f}, inside [{low}, {high}]", flush=True)
            return path
        if rate > high and ladder is DEMO_LADDER_UP and count == DEMO_LADDER_UP[0]:
            ladder, index = DEMO_LADDER_DOWN, 0  # the first count already overshoots: go down instead
            continue
        if (rate > high) == (ladder is DEMO_LADDER_UP):  # crossed the window between two neighbouring counts
            break
        index += 1
    count, (path, rate) = min(tried.items(), key=lambda item: min(abs(item[1][1] - low), abs(item[1][1] - high)))
    summary = ", ".join(f"{n} demos: {r:.2f}" for n, (_, r) in sorted(tried.items()))
    warnings.warn(
        f"{config.env.task}: no demonstration count puts BC held-out success inside [{low}, {high}] ({summary}); "
        f"using {count} demos ({rate:.2f}). Set pretrain.num_demos to choose one yourself.",
        stacklevel=3,
    )
    return path


def search_task_demos(config: RunConfig, counts: dict[str, int | None], searched: list[str]) -> Path:
    """Each searched task's count, along TASK_DEMO_LADDER: one BC policy on all tasks per candidate, and every task
    still below target_success_min gets its next count, until none is. A task that ends outside the window (above
    it at one demonstration, below it at the most, or past it in one step) is named in a warning."""
    cfg = config.pretrain
    low, high = cfg.target_success_min, cfg.target_success_max
    rung = dict.fromkeys(searched, 0)
    while True:
        counts |= {task: TASK_DEMO_LADDER[index] for task, index in rung.items()}
        path, report = cached_bc_checkpoint(with_demo_counts(config, counts))
        rates = {task: report["per_task"][task][0] for task in counts}
        rising = [task for task in rung if rates[task] < low and rung[task] + 1 < len(TASK_DEMO_LADDER)]
        if not rising:
            break
        for task in rising:
            rung[task] += 1
        rung = {task: rung[task] for task in rising}  # a task that reached the window keeps its count
    chosen = ", ".join(f"{task} {counts[task]} ({rates[task]:.2f})" for task in searched)
    print(f"[pretrain] {config.env.task}: demonstrations per task (held-out success): {chosen}", flush=True)
    outside = [task for task in searched if not low <= rates[task] <= high]
    if outside:
        summary = ", ".join(f"{task} {rates[task]:.2f} at {counts[task]} demos" for task in outside)
        warnings.warn(f"{config.env.task}: BC held-out success outside [{low}, {high}] for {summary}. Set pretrain.task_demos "
                      "to choose their counts yourself.", stacklevel=3)  # fmt: skip
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (its env/policy/pretrain sections are used)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (must not exist yet)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not args.out.strip() or out.exists():
        print(f"error: --out {args.out!r} {'already exists' if args.out.strip() else 'is empty'}: name a new directory", file=sys.stderr)
        return 2
    if config.pretrain.num_demos is None:  # the per-task search, through the cache, then a copy of the chosen checkpoint
        chosen = ensure_bc_checkpoint(config)
        write_directory_atomically(out, lambda tmp: shutil.copytree(chosen, tmp, dirs_exist_ok=True))
        report = json.loads((out / REPORT_FILE).read_text())
    else:
        report = pretrain(config, out)
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
