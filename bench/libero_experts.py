"""The LIBERO scripted experts' success per task, on LIBERO's own initial states.

    python -m bench.libero_experts --benchmark libero_object --episodes 50   # every task, all 50 of its init states
    python -m bench.libero_experts --benchmark pick_up_the_milk_and_place_it_in_the_basket --episodes 2   # a smoke run
    python -m bench.libero_experts --action-noise 0.1 --episodes 10   # with pretrain.demo_noise's default noise

Each task's expert (the suite's `expert(task)`) runs through common.demonstrations, as behaviour cloning's
demonstrations are made (with --action-noise as their noise, none by default), on the first --episodes layouts of
benchmark seed 0, which are LIBERO's init states 0, 1, ...; an episode ends at its first success or at the task's
episode limit (lerobot's). No camera is drawn. A task whose benchmark has no expert is listed as such, not left out.
Prints one line per task as it ends, then the figures as one JSON object and `name: value` lines (bench.report.emit),
then a markdown table of each task's success rate with its Wilson 95% interval.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.report import emit, load_average
from common.config import EnvConfig
from common.demonstrations import demonstration_episodes
from common.metrics import counts_interval, success_interval
from common.suites import Layout, make_suite
from common.suites.libero import INIT_STATE_SEED, LAYOUTS_PER_SEED


def task_results(task: str, episodes: int, action_noise: float) -> dict:
    """The expert's episodes of `task` on its first `episodes` init states: successes, rate and interval, steps."""
    limit = make_suite(EnvConfig(suite="libero", task=task)).episode_limit(task)
    suite = make_suite(EnvConfig(suite="libero", task=task, max_episode_steps=limit))
    if suite.expert(task) is None:
        return {"expert": False}
    began = time.perf_counter()
    layouts = [Layout(task, INIT_STATE_SEED, index) for index in range(episodes)]
    runs = list(demonstration_episodes(suite, task, layouts, action_noise, seed=0))
    successes = np.array([run.success for run in runs])
    rate, low, high = success_interval(successes)
    return {"expert": True, "episodes": len(runs), "successes": int(successes.sum()), "success_rate": rate, "wilson_low": low,
            "wilson_high": high, "failed_init_states": [run.layout.index for run in runs if not run.success],
            "mean_steps": float(np.mean([len(run.actions) for run in runs])), "seconds": time.perf_counter() - began}  # fmt: skip


def markdown_table(results: dict[str, dict]) -> str:
    rows = ["| task | successes | success rate (95% Wilson interval) |", "|---|---|---|"]
    for task, result in results.items():
        if not result["expert"]:
            rows.append(f"| {task} | no expert | - |")
            continue
        rate, low, high = result["success_rate"], result["wilson_low"], result["wilson_high"]
        rows.append(f"| {task} | {result['successes']}/{result['episodes']} | {rate:.2f} [{low:.2f}, {high:.2f}] |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="libero_object", help="a LIBERO benchmark, or task names separated by commas (as env.task)")
    parser.add_argument("--episodes", type=int, default=LAYOUTS_PER_SEED, help=f"init states per task, from 0 (at most {LAYOUTS_PER_SEED})")
    parser.add_argument("--action-noise", type=float, default=0.0, help="std of the Gaussian noise added to each action")
    args = parser.parse_args(argv)
    if not 1 <= args.episodes <= LAYOUTS_PER_SEED:
        raise SystemExit(f"--episodes must be in [1, {LAYOUTS_PER_SEED}], got {args.episodes}")
    if args.action_noise < 0:
        raise SystemExit(f"--action-noise must be >= 0, got {args.action_noise}")
    began = time.perf_counter()
    load_start = load_average()
    tasks = make_suite(EnvConfig(suite="libero", task=args.benchmark)).tasks()
    results: dict[str, dict] = {}
    for task in tasks:
        results[task] = task_results(task, args.episodes, args.action_noise)
        outcome = f"{results[task]['successes']}/{results[task]['episodes']}" if results[task]["expert"] else "no expert"
        print(f"[task] {task}: {outcome}", flush=True)
    with_expert = [result for result in results.values() if result["expert"]]
    successes, episodes = sum(result["successes"] for result in with_expert), sum(result["episodes"] for result in with_expert)
    rate, low, high = counts_interval(successes, episodes) if with_expert else (None, None, None)
    emit({"bench": "libero_experts", "benchmark": args.benchmark, "episodes_per_task": args.episodes, "action_noise": args.action_noise,
          "tasks": results, "successes": successes, "episodes": episodes, "success_rate": rate, "wilson_low": low,
          "wilson_high": high, "wall_seconds": time.perf_counter() - began, "load_average_1m_start": load_start,
          "load_average_1m_end": load_average()})  # fmt: skip
    print(markdown_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
