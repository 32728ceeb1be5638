"""The command line: `python -m learner.parity CHECKPOINT --out DIR`: one lerobot checkpoint scored by both evaluators,
side by side.

    python -m learner.parity outputs/train/pick-place/checkpoints/last/pretrained_model --config configs/smolvla_tiny_lerobot_pick.yaml \\
        --episodes 100 --out outputs/parity/bc

CHECKPOINT is a lerobot checkpoint: lerobot-train's `pretrained_model`, or a run's export (`python -m learner.export`).
It is scored twice on Metaworld in lerobot's layout:
  the project   its held-out evaluation with lerobot's semantics (env.observations lerobot: lerobot's frames, state,
                sentence and 500-step limit; each chain started from N(0, I) as lerobot's sampler starts it,
                policy.eval_init_noise_std 1.0), on the first --episodes held-out layouts;
  lerobot-eval  lerobot's own evaluator (through learner.lerobot_tools), --episodes episodes from its own resets
                (seeded by --seed), on the export of the policy the run starts from.
The policy is the run's start (learner.bc.starting_checkpoint.lerobot_start_checkpoint): the checkpoint as it is, its
padded action elements held at zero so that both samplers sample it alike. The two draw their initial states apart
(benchmark layouts and lerobot's seeded redraws of the same distribution), so they agree when their Wilson 95% intervals
meet. Both, with their intervals and the verdict, go to stdout and DIR/parity.json; lerobot-eval's own output and the
export it scored stay in DIR. Bad input is one line and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig
from common.config_loading import load_config
from common.console import log
from common.lerobot_checkpoint import check_features, is_lerobot_checkpoint
from common.metrics import counts_interval
from common.suites import make_suite
from learner.command_shell import CommandFailed, input_checks, run_command

PARITY_FILE = "parity.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m learner.parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a lerobot checkpoint: lerobot-train's pretrained_model, or learner.export's output")
    parser.add_argument("--config", help="YAML run config whose env and policy sections are the run's (its lerobot layout)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--episodes", type=int, default=100, help="episodes each evaluator runs (default 100)")
    parser.add_argument("--batch-size", type=int, default=10, help="lerobot-eval's envs stepped together (default 10)")
    parser.add_argument("--seed", type=int, default=1000, help="lerobot-eval's seed (default 1000)")
    parser.add_argument("--out", required=True, help="directory to write (must not exist)")
    return parser.parse_args(argv)


def check_input(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    checkpoint, out = Path(args.checkpoint).expanduser(), Path(args.out)
    if not is_lerobot_checkpoint(checkpoint):
        raise ConfigError(
            f"{checkpoint} is not a lerobot checkpoint (no config.json naming input_features): give lerobot-train's "
            "pretrained_model, or export a run's checkpoint with python -m learner.export first"
        )
    if not args.out.strip() or out.exists():
        raise ConfigError(f"--out {args.out!r} {'already exists' if args.out.strip() else 'is empty'}: name a new directory")
    if args.episodes < 1 or args.batch_size < 1:
        raise ConfigError(f"--episodes and --batch-size must be >= 1, got {args.episodes} and {args.batch_size}")
    config = load_config(args.config, [*args.set, f"init_checkpoint={checkpoint}", "policy.eval_init_noise_std=1.0"])
    suite = make_suite(config.env)
    if config.env.suite != "metaworld" or not config.env.lerobot_observations or len(suite.tasks()) != 1:
        raise ConfigError(
            f"learner.parity scores one Metaworld task in lerobot's layout (lerobot-eval's env.type=metaworld); the "
            f"config gives env.suite {config.env.suite!r}, env.observations {config.env.observations!r}, "
            f"env.task {config.env.task!r}"
        )
    if args.episodes > len(suite.held_out(args.episodes)):
        raise ConfigError(f"--episodes {args.episodes} exceeds the held-out layouts of env.eval_benchmark_seeds")
    suite.check(config.policy)
    check_features(config, suite)
    return config, out


def lerobot_eval(export: Path, task: str, episodes: int, batch_size: int, seed: int, output: Path) -> dict[str, Any]:
    """lerobot-eval's overall result on `export`, run as a user runs it (learner.lerobot_tools, in its own process)."""
    command = [
        sys.executable,
        "-m",
        "learner.lerobot_tools",
        "eval",
        f"--policy.path={export}",
        "--env.type=metaworld",
        f"--env.task={task}",
        f"--eval.n_episodes={episodes}",
        f"--eval.batch_size={min(batch_size, episodes)}",
        "--policy.device=cpu",
        f"--seed={seed}",
        f"--output_dir={output}",
    ]
    done = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise CommandFailed(f"lerobot-eval exited {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
    return json.loads((output / "eval_info.json").read_text())["overall"]


def parity(args: argparse.Namespace) -> int:
    with input_checks():
        config, out = check_input(args)
    # Imported after the checks: torch, the envs and the backends.
    from actors.rollout_actor import RolloutActor
    from common.policy import FlowPolicy, write_directory_atomically
    from learner.bc.starting_checkpoint import lerobot_start_checkpoint

    start = lerobot_start_checkpoint(config)
    suite = make_suite(config.env)
    task, layouts = suite.tasks()[0], suite.held_out(args.episodes)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        began = time.perf_counter()
        export = write_directory_atomically(tmp / "start_export", lambda directory: FlowPolicy.from_pretrained(start).to_lerobot(directory))
        actor = RolloutActor(config, 0, start)
        try:
            successes = actor.evaluate(None, layouts)[1]
        finally:
            actor.close()
        project_seconds = time.perf_counter() - began
        log.info(
            f"[parity] the project's evaluation: {int(successes.sum())} of {len(successes)} in {project_seconds:.0f}s; lerobot-eval next"
        )
        began = time.perf_counter()
        overall = lerobot_eval(export, task, args.episodes, args.batch_size, args.seed, tmp / "lerobot_eval")
        lerobot_seconds = time.perf_counter() - began
        project = counts_interval(float(successes.sum()), len(successes))
        theirs = counts_interval(round(overall["pc_success"] * overall["n_episodes"] / 100), int(overall["n_episodes"]))
        agree = project[1] <= theirs[2] and theirs[1] <= project[2]
        result = {
            "checkpoint": str(Path(args.checkpoint).resolve()),
            "start": str(start),
            "task": task,
            "project": {
                "success": project[0],
                "ci95": list(project[1:]),
                "episodes": len(successes),
                "seconds": project_seconds,
                "layouts": f"the first {len(layouts)} of env.eval_benchmark_seeds {config.env.eval_benchmark_seeds}",
            },
            "lerobot_eval": {
                "success": theirs[0],
                "ci95": list(theirs[1:]),
                "episodes": int(overall["n_episodes"]),
                "seconds": lerobot_seconds,
                "seed": args.seed,
            },
            "agree": agree,
        }
        (tmp / PARITY_FILE).write_text(json.dumps(result, indent=2))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name, (rate, low, high), episodes in (("project     ", project, len(successes)), ("lerobot-eval", theirs, overall["n_episodes"])):
        log.info(f"{name}: {rate:.3f} ({low:.3f}-{high:.3f}) on {episodes} episodes")
    log.info(f"agree        : {'yes' if agree else 'NO'}: their 95% intervals {'meet' if agree else 'do not meet'}; {out / PARITY_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.parity", lambda: parity(args))


if __name__ == "__main__":
    sys.exit(main())
