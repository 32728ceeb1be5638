"""The command line: the suite's scripted demonstrations as a LeRobotDataset (common.lerobot_dataset).

    python -m learner.dataset --config configs/smolvla_tiny_lerobot_pick.yaml --out datasets/pick-place --episodes 50

Writes what the run's policy observes (env.observations: lerobot's Metaworld layout is one 480-pixel observation.image,
a 4-element observation.state and lerobot's sentence), the executed action, one episode per layout of
env.demo_benchmark_seed, with lerobot's dataset API: `lerobot-train --dataset.root=<out>` trains on it as on any
LeRobotDataset (docs/lerobot.md), and `pretrain.dataset: <out>` makes it the project's behaviour-cloning data. Bad input
is one line on stderr and exit status 2, before anything is written; a stopped or failed write leaves no directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common.config import ConfigError
from common.config_loading import load_config
from common.console import log
from common.lerobot_dataset import write_demonstrations
from learner.command_shell import run_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.dataset", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML run config (its env, policy and pretrain sections say what to record)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="the dataset directory to write (must not exist, unless --overwrite)")
    parser.add_argument("--episodes", type=int, default=50, help="demonstrations per task (default 50: every layout of the seed)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    return run_command("python -m learner.dataset", lambda: write_dataset(args))


def write_dataset(args: argparse.Namespace) -> int:
    start = time.perf_counter()

    def progress(task: str, episode) -> None:
        log.info(
            f"[dataset] {task} layout {episode.layout.benchmark_seed}-{episode.layout.index:02d}: {len(episode.actions)} frames, "
            f"{'success' if episode.success else 'no success'} ({time.perf_counter() - start:.0f}s)"
        )

    config = load_config(args.config, args.set)
    if not args.out.strip():
        raise ConfigError("--out is empty: name the dataset directory")
    written = write_demonstrations(config, Path(args.out), args.episodes, args.overwrite, progress)
    log.info(
        f"[dataset] {written['episodes']} episodes ({written['successes']} successes), {written['frames']} frames at "
        f"{written['fps']} fps, features {written['features']}: {args.out} in {time.perf_counter() - start:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
