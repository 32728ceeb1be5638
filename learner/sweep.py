"""One training per seed, as Ray Tune trials: `python -m learner.sweep --seeds 0 1 2 3 [--set ...]`.

Every trial is the main job (`learner.main.run`) with one run seed, in its own run directory under the sweep
directory. A trial reserves everything its run needs (the trial itself, the learner and every rollout actor) as one
placement group, so a cluster runs as many seeds side by side as it has room for, and one machine runs them in
sequence. The behaviour-cloned starting checkpoint is built once, before any trial starts, and every seed fine-tunes
the same one.

The sweep writes `results.json`, `results.md` (BC success, final success with 95% intervals, gain, wall time and
status per seed, and the mean) and `seeds.png` (every seed's held-out curve and their mean). A failed trial is a row
with its error, never dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig
from common.config_loading import load_config
from common.console import log
from common.metrics import MetricsLog, evaluated_tasks, plot_seed_curves, task_key, tasks_against_start
from learner.command_shell import input_checks, run_command
from learner.main import run
from learner.runtime.ray_runtime import actor_request, learner_request, start_local_ray
from learner.runtime.startup import preflight, resolve_init_checkpoint

TRIAL_CPUS = 0.01  # the trial's own process: it only orchestrates, its learner and actors hold the real reservation


def trial_config(base: RunConfig, seed: int, sweep_dir: Path, node_cpus: float) -> RunConfig:
    """The run of one seed: its own run directory, and resources pinned so that they fit the trial's placement group.
    A trial is sized for one node of `node_cpus` CPUs (the largest), so that seeds run side by side, one per node."""
    config = replace(base, seed=seed, run_dir=str((sweep_dir / f"seed_{seed}").resolve()))
    learner = learner_request(config, node_cpus - TRIAL_CPUS)
    actor = actor_request(config, [node_cpus - TRIAL_CPUS])
    return replace(
        config,
        learner=replace(config.learner, num_cpus=learner.num_cpus),
        actors=replace(config.actors, num_cpus=actor.num_cpus),
    )


def placement_bundles(config: RunConfig) -> list[dict[str, float]]:
    """The trial's reservation: its own process first (Tune's convention), then the learner, then each actor, in
    the order LEARNER_BUNDLE and FIRST_ACTOR_BUNDLE name."""
    cpus = config.learner.num_cpus + config.actors.num_cpus * config.actors.num_actors  # both pinned by trial_config
    learner, actor = learner_request(config, cpus), actor_request(config, [cpus])
    return [{"CPU": TRIAL_CPUS}, learner.amounts()] + [actor.amounts()] * config.actors.num_actors


def train_one_seed(trial: dict[str, Any]) -> dict[str, Any]:
    """Tune trainable: the main job for one seed; returns the figures the sweep table needs."""
    config: RunConfig = trial["config"]
    start = time.perf_counter()
    summary = run(config, include_dashboard=False)
    return {
        "seed": config.seed,
        "initial": summary.get("initial_eval", {}),
        "final": summary.get("final_eval", {}),
        "gain": summary.get("success_gain"),
        "env_steps": summary.get("env_steps"),
        "wall_seconds": time.perf_counter() - start,
        "run_dir": config.run_dir,
    }


def run_sweep(base: RunConfig, seeds: list[int], sweep_dir: Path, address: str | None = None) -> list[dict[str, Any]]:
    """Run every seed as a Tune trial; returns one row per seed (failed trials included, with their error)."""
    import ray
    from ray import tune

    sweep_dir.mkdir(parents=True, exist_ok=True)
    # Build (or find) the shared starting checkpoint before any trial: trials must not race to build it.
    checkpoint = resolve_init_checkpoint(base)
    base = replace(base, init_checkpoint=None if checkpoint is None else str(checkpoint))
    if ray.is_initialized():
        pass
    elif address:
        ray.init(address=address)
    else:
        start_local_ray(include_dashboard=False)
    node_cpus = max(node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"])
    configs = {seed: trial_config(base, seed, sweep_dir, node_cpus) for seed in seeds}
    trainable = tune.with_resources(train_one_seed, tune.PlacementGroupFactory(placement_bundles(configs[seeds[0]]), strategy="PACK"))
    tuner = tune.Tuner(
        trainable,
        param_space={"config": tune.grid_search([configs[seed] for seed in seeds])},
        run_config=tune.RunConfig(name="trials", storage_path=str(sweep_dir.resolve()), verbose=1),
    )
    results = tuner.fit()
    rows = []
    for result in results:
        seed = result.config["config"].seed
        if result.error is not None:
            rows.append({"seed": seed, "status": "failed", "error": _last_line(result.error), "run_dir": configs[seed].run_dir})
        else:
            rows.append(
                {
                    "status": "ok",
                    **{k: result.metrics[k] for k in ("seed", "initial", "final", "gain", "env_steps", "wall_seconds", "run_dir")},
                }
            )
    return sorted(rows, key=lambda row: row["seed"])


def _last_line(error: BaseException) -> str:
    """The root cause of a trial's failure, in one line (Tune wraps it in its own error types)."""
    cause = error
    while getattr(cause, "cause", None) is not None or cause.__cause__ is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def _interval(result: dict[str, float]) -> str:
    return f"{result['eval/success_rate']:.2f} ({result['eval/success_low']:.2f}-{result['eval/success_high']:.2f})"


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per seed (failed ones with their error), then the mean over the seeds that finished."""
    lines = ["| seed | BC success | final success | gain | env steps | wall time | status |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['seed']} | | | | | | failed: {row['error']} |")
            continue
        lines.append(
            f"| {row['seed']} | {_interval(row['initial'])} | {_interval(row['final'])} | {100 * row['gain']:+.0f} points "
            f"| {row['env_steps']:,} | {row['wall_seconds'] / 60:.1f} min | ok |"
        )
    done = [row for row in rows if row["status"] == "ok"]
    if done:
        gains = np.array([row["gain"] for row in done])
        finals = np.array([row["final"]["eval/success_rate"] for row in done])
        lines.append(
            f"| mean of {len(done)} | {np.mean([r['initial']['eval/success_rate'] for r in done]):.2f} | {finals.mean():.2f} "
            f"| {100 * gains.mean():+.1f} points (min {100 * gains.min():+.0f}) | | "
            f"{np.mean([r['wall_seconds'] for r in done]) / 60:.1f} min | {len(done)}/{len(rows)} ok |"
        )
    return "\n".join(lines)


def task_table(rows: list[dict[str, Any]]) -> str:
    """Markdown for a multi-task sweep ("" otherwise): one row per task, its held-out success before and after RL for
    each seed that finished (with the Wilson intervals), and the mean gain over those seeds; then, per seed, the tasks
    that ended above and below their BC interval."""
    done = [row for row in rows if row["status"] == "ok"]
    tasks = evaluated_tasks([row["final"] for row in done])
    if not tasks:
        return ""
    head = "| task | " + " | ".join(f"seed {row['seed']}: BC -> RL" for row in done) + " | mean gain |"
    lines = [head, "|---" * (len(done) + 2) + "|"]
    for task in tasks:
        cells, gains = [], []
        for row in done:
            before, after = (_task_interval(row[when], task) for when in ("initial", "final"))
            cells.append(f"{before} -> {after}")
            gains.append(row["final"][task_key(task, "success_rate")] - row["initial"][task_key(task, "success_rate")])
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {100 * np.mean(gains):+.1f} points |")
    placed = [tasks_against_start(row["initial"], row["final"]) for row in done]
    for where in ("above", "below"):
        counts = " | ".join(f"{len(tasks[where])} of {len(tasks_of)}" for tasks, tasks_of in ((p, sum(p.values(), [])) for p in placed))
        lines.append(f"| tasks {where} their BC interval | {counts} | |")
    return "\n".join(lines)


def _task_interval(result: dict[str, float], task: str) -> str:
    rate, low, high = (result[task_key(task, name)] for name in ("success_rate", "success_low", "success_high"))
    return f"{rate:.2f} ({low:.2f}-{high:.2f})"


def write_report(rows: list[dict[str, Any]], sweep_dir: Path, title: str) -> str:
    table = results_table(rows)
    if per_task := task_table(rows):
        table += "\n\nPer task (held-out success, 95% intervals):\n\n" + per_task
    (sweep_dir / "results.json").write_text(json.dumps(rows, indent=2))
    (sweep_dir / "results.md").write_text(f"# {title}\n\n{table}\n")
    curves = {}
    for row in rows:
        if row["status"] == "ok":
            curves[row["seed"]] = (row["initial"], MetricsLog(Path(row["run_dir"]) / "metrics.jsonl").read())
    if curves:
        plot_seed_curves(curves, sweep_dir / "seeds.png", title)
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.sweep", description="One training per seed, as Ray Tune trials.")
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="run seeds, one trial each")
    parser.add_argument("--config", help="YAML run config (default: the embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
    parser.add_argument("--sweep-dir", help="where the seeds' runs and the table go (default: runs/sweep-<time>)")
    parser.add_argument("--address", help="Ray cluster to join (default: a local Ray on loopback)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.sweep", lambda: sweep(args))


def sweep(args: argparse.Namespace) -> int:
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise ConfigError(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    base = load_config(args.config, args.set)
    if base.learner.num_learners > 1:
        raise ConfigError(
            f"learner.num_learners={base.learner.num_learners}: a sweep runs each seed's learner alone in the "
            "seed's placement group; set learner.num_learners: 1"
        )
    sweep_dir = Path(args.sweep_dir or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    taken = [seed for seed in args.seeds if (sweep_dir / f"seed_{seed}" / "metrics.jsonl").exists()]
    if taken:
        raise ConfigError(f"{sweep_dir} already holds runs of seeds {taken}: pick another --sweep-dir")
    with input_checks():  # every seed's run would refuse the same input: once, before any starts
        preflight(base, args.address, resume=False)
    rows = run_sweep(base, args.seeds, sweep_dir, args.address)
    title = f"{base.env.task}: {len(args.seeds)} seeds, {base.iterations} iterations"
    log.info(write_report(rows, sweep_dir, title))
    log.info(f"[sweep] table {sweep_dir / 'results.md'}, curves {sweep_dir / 'seeds.png'}")
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
