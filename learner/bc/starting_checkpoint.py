"""The starting policy a run fine-tunes: the behaviour-cloned checkpoint for the run's config, built on first use and
cached by what shapes it (bc_cache_key), with the number of demonstrations chosen per task from held-out success
where the config leaves it open (the demonstration ladders); or a lerobot checkpoint, taken as it is."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from common.config import PretrainConfig, RunConfig, cache_dir
from common.console import log
from common.file_digests import file_sha256, short_digest
from common.lerobot_checkpoint import PREPROCESSOR_FILE
from common.lerobot_checkpoint import normalisation as lerobot_normalisation
from common.policy import WEIGHTS_FILE, CheckpointError, build_policy, write_directory_atomically
from common.suites import make_suite
from learner.bc.training import RECIPE_VERSION, REPORT_FILE, demo_counts, pretrain


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
    for name in ("dataset", "successful_demos_only"):
        if not relevant["pretrain"][name]:
            del relevant["pretrain"][name]
    for section, name, unchanged in (
        ("env", "observations", ("auto", "project")),
        ("env", "render", ("auto", "fast")),
        ("policy", "image_keys", ([],)),
        ("policy", "rename_map", ({},)),
    ):
        if relevant[section][name] in unchanged:
            del relevant[section][name]
    relevant["recipe_version"] = RECIPE_VERSION
    return short_digest(relevant)


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
        log.info(f"[pretrain] {config.env.task}, {describe_counts(config.pretrain)}: building {path} (once; about a minute)")
        report = pretrain(config, path)
        log.info(f"[pretrain] done: held-out success {report['eval_success_rate']:.2f} in {report['seconds']['total']:.0f}s")
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
    relevant |= {
        "seed": config.pretrain.seed,
        "recipe_version": RECIPE_VERSION,
        "files": {path.name: file_sha256(path) for path in files},
        "padded_actions": "held",
    }
    path = cache_dir("lerobot_start") / short_digest(relevant)
    if (path / WEIGHTS_FILE).is_file():
        return path
    stats = lerobot_normalisation(source)
    if stats is None:
        raise CheckpointError(
            f"init_checkpoint {source} has no normaliser in its {PREPROCESSOR_FILE} (a base model, not a trained "
            f"policy): name it as policy.{config.policy.vla_section()}.lerobot_checkpoint, whose weights behaviour "
            "cloning starts from, and leave init_checkpoint unset"
        )
    torch.manual_seed(config.pretrain.seed)
    policy = build_policy(config.policy)
    (state_mean, state_std), (action_mean, action_std) = stats["observation.state"], stats["action"]
    if state_mean.shape != (config.policy.obs_dim,) or action_mean.shape != (config.policy.action_dim,):
        raise CheckpointError(
            f"{source}: its normaliser's state {state_mean.shape} and action {action_mean.shape} statistics are not the "
            f"policy's ({config.policy.obs_dim},) and ({config.policy.action_dim},)"
        )
    # lerobot's actions are in the env's units, the policy's in [-1, 1] (policy.action_bounds)
    centre, half_width = config.policy.action_units()
    action_mean, action_std = (action_mean - centre) / half_width, action_std / half_width
    policy.set_normalization(*(torch.from_numpy(array) for array in (state_mean, state_std, action_mean, action_std)), exact=True)
    padded = policy.hold_padded_actions()
    log.info(
        f"[start] fine-tuning the lerobot checkpoint {source} as it is (its model and normalisation; the noise head and "
        f"critic drawn from pretrain.seed {config.pretrain.seed}): {path}"
    )
    if padded:
        log.info(
            f"[start] its action_in_proj read {padded} padded action elements beyond the policy's {config.policy.action_dim}, "
            "which lerobot's sampler integrates from noise and the run's chain holds at zero: their columns are set to "
            "zero, so both sample this start alike; lerobot-eval's score before RL is that of its export, "
            f"`python -m learner.export {path} --out DIR` (docs/lerobot.md)"
        )
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
                log.info(f"[pretrain] {config.env.task}: {count} demos give held-out success {rate:.2f}, inside [{low}, {high}]")
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
    log.info(f"[pretrain] {config.env.task}: demonstrations per task (held-out success): {chosen}")
    outside = [task for task in searched if not low <= rates[task] <= high]
    if outside:
        summary = ", ".join(f"{task} {rates[task]:.2f} at {counts[task]} demos" for task in outside)
        warnings.warn(
            f"{config.env.task}: BC held-out success outside [{low}, {high}] for {summary}. Set pretrain.task_demos "
            "to choose their counts yourself.",
            stacklevel=3,
        )
    return path
