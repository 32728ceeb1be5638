"""The command line: `python -m learner.diagnose RUN_DIR`: where a run's gain is, task by task.

For two checkpoints of a run, its start (the starting checkpoint its manifest names: the BC policy) and its end (the
run's latest checkpoint, or --checkpoint), each task's success on

  training layouts   --episodes initial states drawn (with --seed) from env.train_benchmark_seeds, the ones the
                     run's rollouts start from, and
  held-out layouts   the first --episodes of env.eval_benchmark_seeds, the run's own evaluation,

each run twice: with the deterministic chain (a_0 = 0, no injected noise: what the run's evaluation scores) and with
the sampling noise on (the policy the rollouts sample and the update improves; its noise drawn from a generator
seeded with --seed). Four cells per task and checkpoint, each with its Wilson 95% interval. With --repeats K, the
noisy policy runs each training layout K times (noise seeds --seed, --seed + 1, ...) and each task's training layouts
are counted by outcome: never, sometimes or always a success. Only the layouts sometimes won give the update a
success to favour over a failure from the same start; a task whose failed layouts are never won by its noise has
nothing there for its advantages to point at.

  a gain on training layouts that held-out layouts lack    the policy learned the initial states it trained on;
  a gain of the noisy policy that the deterministic
  chain lacks                                              the evaluation scores another policy than the one trained.

The checkpoints are loaded as rollout actors load them (actors.rollout_actor.RolloutActor) under the run's config,
one process per checkpoint side by side. The table goes to stdout and RUN_DIR/diagnosis.json (replaced whole);
progress goes to stderr; bad input is one line on stderr and exit status 2, before anything is loaded or written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from common.config import RunConfig
from common.config_loading import from_dict
from common.console import log
from common.metrics import success_interval
from common.storage import write_file_atomically
from common.suites import Layout, make_suite
from learner.command_shell import input_checks, run_command
from learner.files.run_dir import RUN_CONFIG_FILE, policy_directory

DIAGNOSIS_FILE = "diagnosis.json"
LAYOUT_SETS = ("training", "held-out")
MODES = ("deterministic", "noisy")
REPEATS = "training/noisy repeats"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m learner.diagnose",
        description="Success on training and held-out layouts, deterministic and noisy, at a run's start and end, task by task.",
    )
    parser.add_argument("run_dir", help="a run directory (with run_config.json and checkpoints/)")
    parser.add_argument("--checkpoint", help="the end to diagnose: a policy directory (default: the run's latest checkpoint)")
    parser.add_argument("--start", help="the start to compare with (default: the starting checkpoint the run's manifest names)")
    parser.add_argument("--episodes", type=int, help="layouts per task and layout set (default: the run's eval_episodes)")
    parser.add_argument("--seed", type=int, default=0, help="draws the training layouts and the noise (default 0)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="noisy episodes per training layout (default 1); with more, each "
        "task's training layouts are counted as never, sometimes or always won",
    )
    return parser.parse_args(argv)


def starting_checkpoint(run_dir: Path) -> Path:
    """The checkpoint the run started from, as its summary's manifest records it."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise ValueError(f"{run_dir} has no summary.json to name its starting checkpoint: pass --start")
    recorded = json.loads(summary.read_text()).get("manifest", {}).get("init_checkpoint")
    if not recorded:
        raise ValueError(f"{summary} names no starting checkpoint (a randomly initialised run): pass --start")
    return policy_directory(Path(recorded["path"]))


def diagnosis_layouts(config: RunConfig, episodes: int, seed: int) -> dict[str, list[Layout]]:
    """Each layout set's layouts, task by task: `episodes` training layouts drawn with `seed`, the first `episodes`
    held-out ones."""
    suite = make_suite(config.env)
    held_out_pool = len(suite.layouts(suite.tasks()[0], config.env.eval_benchmark_seeds))
    training_pool = len(suite.layouts(suite.tasks()[0], config.env.train_benchmark_seeds))
    if not 1 <= episodes <= min(held_out_pool, training_pool):
        raise ValueError(
            f"--episodes must be in [1, {min(held_out_pool, training_pool)}] (layouts per task of "
            f"env.eval_benchmark_seeds and env.train_benchmark_seeds), got {episodes}"
        )
    rng = np.random.default_rng(seed)
    training = []
    for task in suite.tasks():
        pool = suite.layouts(task, config.env.train_benchmark_seeds)
        training += [pool[i] for i in sorted(rng.choice(len(pool), episodes, replace=False))]
    return {"training": training, "held-out": suite.held_out(episodes)}


def check_input(args: argparse.Namespace) -> tuple[RunConfig, dict[str, Path], dict[str, list[Layout]]]:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (noisy episodes per training layout), got {args.repeats}")
    run_dir = Path(args.run_dir)
    config_file = run_dir / RUN_CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no {RUN_CONFIG_FILE}")
    try:
        config = from_dict(RunConfig, json.loads(config_file.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON ({exc}): the run's record is corrupt") from None
    config.validate()
    start = policy_directory(Path(args.start)) if args.start else starting_checkpoint(run_dir)
    end = policy_directory(Path(args.checkpoint) if args.checkpoint else run_dir)
    episodes = config.eval_episodes if args.episodes is None else args.episodes
    return config, {"start": start, "end": end}, diagnosis_layouts(config, episodes, args.seed)


def successes_of(config: RunConfig, checkpoint: Path, layouts: dict[str, list[Layout]], seed: int, repeats: int) -> dict[str, np.ndarray]:
    """One checkpoint's episodes: successes per '<layout set>/<mode>', and REPEATS (repeats, layouts) of the noisy policy on
    the training layouts, the first repeat being the 'training/noisy' cell's (in one process, as one rollout actor)."""
    from actors.rollout_actor import RolloutActor  # torch, the envs and the backends: only in the worker

    actor = RolloutActor(config, 0, checkpoint)
    try:
        successes = {
            f"{name}/{mode}": actor.evaluate(None, layouts[name], None if mode == "deterministic" else seed)[1]
            for name in LAYOUT_SETS
            for mode in MODES
        }
        more = [actor.evaluate(None, layouts["training"], seed + repeat)[1] for repeat in range(1, repeats)]
        return successes | {REPEATS: np.stack([successes["training/noisy"], *more])}
    finally:
        actor.close()


def layout_outcomes(repeats: np.ndarray, layouts: list[Layout]) -> dict[str, dict[str, float]]:
    """{task: shares of its layouts never, sometimes and always won over the repeats (repeats, layouts), and their count}."""
    tasks = np.array([layout.task for layout in layouts])
    won = repeats.sum(axis=0)
    table = {}
    for task in dict.fromkeys(tasks):
        mine = won[tasks == task]
        table[task] = {
            "never": float(np.mean(mine == 0)),
            "sometimes": float(np.mean((mine > 0) & (mine < len(repeats)))),
            "always": float(np.mean(mine == len(repeats))),
            "layouts": len(mine),
        }
    return table


def cells(successes: dict[str, np.ndarray], layouts: dict[str, list[Layout]]) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {'<layout set>/<mode>': {success, low, high, episodes}}}, and the tasks' mean as task 'mean'."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for cell, outcomes in successes.items():
        if cell == REPEATS:
            continue
        tasks = np.array([layout.task for layout in layouts[cell.split("/")[0]]])
        for task in [*dict.fromkeys(tasks), "mean"]:
            chosen = outcomes if task == "mean" else outcomes[tasks == task]
            rate, low, high = success_interval(chosen)
            table.setdefault(task, {})[cell] = {"success": rate, "low": low, "high": high, "episodes": len(chosen)}
    return table


def markdown(diagnosis: dict[str, dict]) -> str:
    """One row per task: each cell as start -> end (gain in points), the end's 95% interval in brackets."""
    start, end = diagnosis["start"]["cells"], diagnosis["end"]["cells"]
    columns = [f"{name}/{mode}" for name in LAYOUT_SETS for mode in MODES]
    lines = ["| task | " + " | ".join(f"{column.replace('/', ', ')}" for column in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for task in end:
        row = []
        for column in columns:
            before, after = start[task][column]["success"], end[task][column]
            gain = 100 * (after["success"] - before)
            row.append(f"{before:.2f} -> {after['success']:.2f} ({gain:+.0f}) [{after['low']:.2f}-{after['high']:.2f}]")
        lines.append(f"| {'**mean**' if task == 'mean' else task} | " + " | ".join(row) + " |")
    if "layout_outcomes" in diagnosis["end"]:
        lines += ["", "| task | training layouts never / sometimes / always won by the noisy policy: start | end |", "|---|---|---|"]
        for task in diagnosis["end"]["layout_outcomes"]:
            shares = [diagnosis[label]["layout_outcomes"][task] for label in ("start", "end")]
            lines.append(f"| {task} | " + " | ".join(f"{o['never']:.2f} / {o['sometimes']:.2f} / {o['always']:.2f}" for o in shares) + " |")
    return "\n".join(lines)


def diagnose(args: argparse.Namespace) -> int:
    with input_checks():
        config, checkpoints, layouts = check_input(args)
    episodes = len(layouts["held-out"]) // len(make_suite(config.env).tasks())
    log.error(
        f"[diagnose] {len(set(checkpoints.values()))} checkpoints x {len(LAYOUT_SETS)} layout sets x {len(MODES)} modes, {episodes} "
        f"episodes per task each (the noisy training cell {args.repeats} times); one process per checkpoint"
    )
    began = time.monotonic()
    # Spawned, not forked: a forked child inherits the parent's MuJoCo and torch thread state.
    distinct = list(dict.fromkeys(checkpoints.values()))  # a start given as the end is run once
    with ProcessPoolExecutor(min(len(distinct), os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {path: pool.submit(successes_of, config, path, layouts, args.seed, args.repeats) for path in distinct}
        diagnosis = {}
        for label, path in checkpoints.items():
            successes = futures[path].result()
            diagnosis[label] = {"checkpoint": str(path), "cells": cells(successes, layouts)}
            if args.repeats > 1:
                diagnosis[label]["layout_outcomes"] = layout_outcomes(successes[REPEATS], layouts["training"])
            log.error(f"[diagnose] {label} ({path}) done at {time.monotonic() - began:.0f}s")
    report = {
        **diagnosis,
        "episodes_per_task": episodes,
        "seed": args.seed,
        "repeats": args.repeats,
        "layout_sets": {
            "training": f"drawn from env.train_benchmark_seeds {config.env.train_benchmark_seeds} with seed {args.seed}",
            "held-out": f"the first of env.eval_benchmark_seeds {config.env.eval_benchmark_seeds}",
        },
    }
    write_file_atomically(Path(args.run_dir) / DIAGNOSIS_FILE, json.dumps(report, indent=2))
    log.info(markdown(diagnosis))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.diagnose", lambda: diagnose(args))


if __name__ == "__main__":
    sys.exit(main())
