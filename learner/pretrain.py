"""Behaviour-cloning pre-training of the flow policy from a suite's scripted demonstrations (Metaworld's experts) or a
LeRobotDataset, and what a demonstration is worth.

    python -m learner.pretrain --out checkpoints/bc            # defaults from common.config.PretrainConfig
    python -m learner.pretrain --set pretrain.num_demos=7 --out /tmp/bc7
    python -m learner.pretrain --demos 1,2,5,10,20,50 --out runs/cloning   # cloning's curve over the demonstration count
    python -m learner.pretrain --demos 10,50 --train-steps 3000,10000,30000 --out runs/cloning-ceiling

RL fine-tuning starts from a pre-trained policy, and no weights are downloaded at run time, so the project
makes its own: the scripted expert is rolled out (with action noise) on `pretrain.num_demos` layouts of
`env.demo_benchmark_seed`, the velocity field is trained with the conditional flow-matching loss, and the
checkpoint (safetensors + config + normalisation statistics as buffers) is evaluated deterministically
on held-out layouts. With `pretrain.num_demos: null` (the default) the number of demonstrations is chosen per task so
that held-out success lands in [pretrain.target_success_min, target_success_max] (ensure_bc_checkpoint; every
candidate is cached), a start that leaves RL room to show what it adds.

`--demos` clones each count of demonstrations per task (every task alike) and scores each clone on the same
held-out layouts: the figure an RL run is set beside (docs/results.md). `--train-steps` trains each count for each
budget given (default: pretrain.train_steps), since a larger dataset keeps gaining from training after a smaller one
has stopped; the table marks each count's best, what cloning those demonstrations reaches. It writes a directory
with one checkpoint per count and budget (`demos_NNN_steps_SSSSS/`, each loadable by `learner.main --checkpoint`) and
`curve.json`, and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig
from common.config_loading import load_config
from common.console import log
from common.lerobot_dataset import check_dataset
from common.policy import write_directory_atomically
from common.suites import make_suite
from learner.bc.starting_checkpoint import cached_bc_checkpoint, ensure_bc_checkpoint, with_demo_counts
from learner.bc.training import REPORT_FILE, check_task_demos, pretrain
from learner.command_shell import run_command

CURVE_FILE = "curve.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m learner.pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML run config (its env/policy/pretrain sections are used)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="directory to write (must not exist yet)")
    parser.add_argument("--demos", metavar="N,N,...", help="clone each count of demonstrations per task and score each (cloning's curve)")
    parser.add_argument(
        "--train-steps", metavar="S,S,...", help="with --demos: train each count for each of these budgets (default: pretrain.train_steps)"
    )
    return parser.parse_args(argv)


def distinct_counts(text: str | None, flag: str, low: int, high: float, example: str) -> list[int]:
    """A flag's comma-separated counts: distinct integers in [low, high], in the order given; [] without the flag."""
    if text is None:
        return []
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or len(set(counts)) != len(counts) or not all(low <= count <= high for count in counts):
        bounds = f"in [{low}, {high}]" if high < float("inf") else f">= {low}"
        raise ConfigError(f"{flag} must be distinct counts {bounds} separated by commas (e.g. {example}), got {text!r}")
    return counts


def check_input(args: argparse.Namespace) -> tuple[RunConfig, Path, list[int], list[int]]:
    """The config, the output directory, the --demos counts and their training budgets, or a ConfigError before anything
    is written."""
    counts = distinct_counts(args.demos, "--demos", 1, 50, "1,2,5,10,20,50")
    budgets = distinct_counts(args.train_steps, "--train-steps", 1, float("inf"), "3000,10000,30000")
    if budgets and not counts:
        raise ConfigError("--train-steps gives the budgets of --demos' clones: add --demos, or set pretrain.train_steps")
    # --demos gives every count itself: pretrain.num_demos null (the search, which needs 20 held-out layouts) is not run
    config = load_config(args.config, [*args.set, f"pretrain.num_demos={counts[0]}"] if counts else args.set)
    out = Path(args.out)
    if not args.out.strip() or out.exists():
        raise ConfigError(f"--out {args.out!r} {'already exists' if args.out.strip() else 'is empty'}: name a new directory")
    suite = make_suite(config.env)
    suite.check(config.policy)
    check_task_demos(config.pretrain, suite.tasks())
    if config.pretrain.dataset:
        if counts:
            raise ConfigError("--demos counts the scripted expert's demonstrations, and pretrain.dataset names a dataset instead: drop one")
        check_dataset(Path(config.pretrain.dataset).expanduser(), config.policy, suite)
    if counts and config.pretrain.eval_episodes < 1:
        raise ConfigError("--demos scores every clone on held-out layouts: set pretrain.eval_episodes >= 1 (100 for a figure)")
    return config, out, counts, budgets or [config.pretrain.train_steps]


def pretrain_command(args: argparse.Namespace) -> int:
    config, out, counts, budgets = check_input(args)
    if counts:
        curve = cloning_curve(config, counts, budgets, out)
        log.info(curve_table(curve))
        log.info(f"[pretrain] {out}: a checkpoint per row (demos_NNN_steps_SSSSS/) and {CURVE_FILE}")
        return 0
    if config.pretrain.num_demos is None and not config.pretrain.dataset:  # the per-task search, then a copy of the chosen one
        chosen = ensure_bc_checkpoint(config)
        write_directory_atomically(out, lambda tmp: shutil.copytree(chosen, tmp, dirs_exist_ok=True))
        report = json.loads((out / REPORT_FILE).read_text())
    else:
        report = pretrain(config, out)
    log.info(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    return 0


def cloning_curve(config: RunConfig, counts: list[int], budgets: list[int], out: Path) -> dict[str, Any]:
    """Each count of demonstrations per task cloned for each training budget (through the BC cache) and scored on
    pretrain.eval_episodes held-out layouts a task; written with a copy of each checkpoint into `out` at once,
    atomically. Returns curve.json's content: a row per count and budget, each count's best marked."""
    tasks = make_suite(config.env).tasks()
    clones, rows = {}, []
    for count in counts:
        for steps in budgets:
            trained = dataclasses.replace(config, pretrain=dataclasses.replace(config.pretrain, train_steps=steps))
            name = f"demos_{count:03d}_steps_{steps:05d}"
            clones[name], report = cached_bc_checkpoint(with_demo_counts(trained, dict.fromkeys(tasks, count)))
            rows.append(
                {
                    "demos_per_task": count,
                    "train_steps": steps,
                    "success": report["eval_success_rate"],
                    "ci95": report["eval_success_95ci"],
                    "per_task": report.get("per_task", {}),
                    "demo_success_rate": report["demo_success_rate"],
                    "checkpoint": name,
                    "best": False,
                }
            )
        best = max((row for row in rows if row["demos_per_task"] == count), key=lambda row: row["success"])
        best["best"] = True
    curve = {"task": config.env.task, "tasks": tasks, "eval_layouts": report["eval_layouts"], "rows": rows}

    def write(tmp: Path) -> None:
        for name, clone in clones.items():
            shutil.copytree(clone, tmp / name)
        (tmp / CURVE_FILE).write_text(json.dumps(curve, indent=2))

    write_directory_atomically(out, write)
    return curve


def curve_table(curve: dict[str, Any]) -> str:
    """curve.json as a markdown table: one row per count and budget, each count's best in bold, with each task's success
    where there are several."""
    tasks = curve["tasks"] if len(curve["tasks"]) > 1 else []
    lines = [
        f"cloning {curve['task']}: held-out success ({curve['eval_layouts']}), deterministic, Wilson 95% intervals; "
        "in bold, each count's best over its training budgets",
        "| demonstrations per task | training steps | success (95% CI) |" + "".join(f" {task} |" for task in tasks),
        "|---|---|---|" + "---|" * len(tasks),
    ]
    for row in curve["rows"]:
        low, high = row["ci95"]
        success = f"{row['success']:.3f} ({low:.3f}-{high:.3f})"
        per_task = "".join(f" {row['per_task'][task][0]:.2f} |" for task in tasks)
        lines.append(f"| {row['demos_per_task']} | {row['train_steps']} | {f'**{success}**' if row['best'] else success} |{per_task}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.pretrain", lambda: pretrain_command(args))


if __name__ == "__main__":
    sys.exit(main())
