"""The command line: `python -m learner.replay CHECKPOINT`: deterministic held-out episodes of a checkpoint, as MP4s.

CHECKPOINT is a policy directory written by save_pretrained (a BC checkpoint, or a run's checkpoints/iter_NNNNNN), or
a run directory or its checkpoints/ directory (then the run's latest checkpoint). It is loaded as a rollout actor
loads it (actors.rollout_actor.RolloutActor: FlowPolicy.from_pretrained with the run config's sampling fields and
actors.speed.precision), for every backend. A run checkpoint's trainer state is not read.

The run config gives the env rules (task, episode length, held-out benchmark seeds) and the sampling fields:
  --config FILE             when given;
  run_dir/run_config.json   for a run's checkpoint, the run's own;
  otherwise                 the defaults, with the checkpoint's own policy section and, for a BC checkpoint, the
                            env section its pretrain.json records (the rules it was evaluated under).
--task replays another of the suite's tasks (env.task replaced); for a multi-task policy it picks one of the run's
own tasks, whose task input the policy was trained with (env.task kept, only that task's layouts replayed).
The episodes are the first --episodes layouts of the held-out pool (Suite.layouts(task,
env.eval_benchmark_seeds) for each task replayed, where a run's evaluation starts), or with --seed S as many drawn from it by a generator
seeded with S. Each is run alone (a batch of one) with deterministic sampling, so it is a function of checkpoint,
config and layout; a run's evaluation batched it with others (actors.envs_per_actor), and a policy whose float sums
depend on the batch can, rarely, end that episode otherwise: a run's own videos (common.recording) are filmed in
its evaluation's batches.

--compare OTHER films OTHER on the same layouts, under CHECKPOINT's env rules, beside it in one video per episode.
One summary line per episode goes to stdout, progress to stderr; bad input is one line on stderr and exit status 2,
before anything is loaded or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from common.config import RunConfig
from common.config_loading import from_dict, load_config
from common.console import log
from common.policy import read_policy_config
from common.recording import VIDEO_SIZE, EpisodeRecording, layout_id
from common.suites import Layout, make_suite
from common.video import side_by_side, write_mp4
from learner.bc.training import REPORT_FILE
from learner.command_shell import input_checks, run_command
from learner.files.run_dir import RUN_CONFIG_FILE, policy_directory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.replay", description="Film deterministic held-out episodes of a checkpoint.")
    parser.add_argument("checkpoint", help="policy directory, run directory, or a run's checkpoints/ directory")
    parser.add_argument("--task", help="the suite's task to replay on (default: the config's env.task)")
    parser.add_argument("--episodes", type=int, default=2, help="held-out layouts to film (default 2)")
    parser.add_argument("--out", default="replay_videos", help="directory for the MP4s (default ./replay_videos)")
    parser.add_argument("--size", type=int, default=VIDEO_SIZE, help=f"frame side in pixels (default {VIDEO_SIZE})")
    parser.add_argument("--camera", help="the suite's camera to film with (default: its film camera, Metaworld's corner4)")
    parser.add_argument("--compare", metavar="OTHER", help="a second checkpoint, filmed beside the first on the same layouts")
    parser.add_argument("--seed", type=int, help="draw the layouts from the held-out pool with this seed (default: the first ones)")
    parser.add_argument("--config", help="YAML run config for env rules and sampling fields (default: the checkpoint's run's, see above)")
    return parser.parse_args(argv)


def run_config(checkpoint: Path, config_file: str | None, task: str | None) -> RunConfig:
    """The config to replay `checkpoint` under (module docstring), with `task` as env.task when given and the config
    is a single-task one (a multi-task config keeps its task list: the policy's task input depends on it)."""
    run_file = checkpoint.parent.parent / RUN_CONFIG_FILE
    if config_file is not None:
        config = load_config(config_file)
    elif checkpoint.parent.name == "checkpoints" and run_file.is_file():
        config = from_dict(RunConfig, json.loads(run_file.read_text()))
    else:
        report = checkpoint / REPORT_FILE
        env = json.loads(report.read_text())["config"]["env"] if report.is_file() else {}
        config = from_dict(RunConfig, {"env": env, "policy": dataclasses.asdict(read_policy_config(checkpoint))})
    config.validate()
    if task is not None and len(make_suite(config.env).tasks()) == 1:
        config = dataclasses.replace(config, env=dataclasses.replace(config.env, task=task))
        config.validate()
    return config


def chosen_layouts(config: RunConfig, episodes: int, seed: int | None, task: str | None) -> list[Layout]:
    """The layouts to replay, from the held-out pool of `task` (None: of every task of the config)."""
    suite = make_suite(config.env)
    tasks = suite.tasks() if task is None else [task]
    pool = [layout for name in tasks for layout in suite.layouts(name, config.env.eval_benchmark_seeds)]
    if not 1 <= episodes <= len(pool):
        raise ValueError(f"--episodes must be in [1, {len(pool)}] (the held-out layouts of env.eval_benchmark_seeds), got {episodes}")
    if seed is None:
        return pool[:episodes]
    return [pool[i] for i in sorted(np.random.default_rng(seed).choice(len(pool), episodes, replace=False))]


def label(checkpoint: Path) -> str:
    """A checkpoint's name in a caption: a run's checkpoint by run and iteration."""
    return f"{checkpoint.parent.parent.name}/{checkpoint.name}" if checkpoint.parent.name == "checkpoints" else checkpoint.name


def check_input(args: argparse.Namespace) -> tuple[list[tuple[Path, RunConfig]], list[Layout]]:
    """Everything that can be checked without loading a policy: each checkpoint with its config, the layouts, --out.
    OTHER keeps its own sampling fields and actors section but takes CHECKPOINT's env rules (the same initial states)."""
    if args.size < 16:
        raise ValueError(f"--size must be >= 16 pixels, got {args.size}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    checkpoint = policy_directory(Path(args.checkpoint))
    config = run_config(checkpoint, args.config, args.task)
    if args.task is not None:
        suite = make_suite(config.env)
        try:
            suite.instruction(args.task)
        except ValueError as exc:
            raise ValueError(f"--task: {exc}") from None
        tasks = suite.tasks()
        if args.task not in tasks:
            raise ValueError(f"--task {args.task} is not one of the multi-task policy's tasks {tasks} (env.task {config.env.task})")
    replays = [(checkpoint, config)]
    if args.compare is not None:
        other = policy_directory(Path(args.compare))
        replays.append((other, dataclasses.replace(run_config(other, args.config, None), env=config.env)))
    return replays, chosen_layouts(config, args.episodes, args.seed, args.task)


def replay(args: argparse.Namespace) -> int:
    with input_checks():
        replays, chosen = check_input(args)
        # Imported after the checks: it brings in torch, the envs and the policy backends.
        from actors.rollout_actor import RolloutActor

        actors = [RolloutActor(config, 0, checkpoint) for checkpoint, config in replays]
    checkpoints = [checkpoint for checkpoint, _ in replays]
    try:
        for number, layout in enumerate(chosen, 1):
            log.error(
                f"[replay] episode {number}/{len(chosen)}: {layout.task} layout {layout_id(layout)} "
                f"({' vs '.join(map(label, checkpoints))})"
            )
            recordings = [actor.record_episodes(None, [layout], args.size, camera=args.camera)[0] for actor in actors]
            log.info(summary(recordings, checkpoints, write(Path(args.out), recordings, checkpoints)))
    finally:
        for actor in actors:
            actor.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.replay", lambda: replay(args))


def write(out: Path, recordings: list[EpisodeRecording], checkpoints: list[Path]) -> Path:
    first = recordings[0]
    if len(recordings) == 1:
        return write_mp4(out / first.file_name, first.captioned())
    second = recordings[1]
    name = f"{first.task}_{first.layout_id}_{first.outcome}_{first.steps}steps_vs_{second.outcome}_{second.steps}steps.mp4"
    frames = side_by_side(first.captioned(label(checkpoints[0])), second.captioned(label(checkpoints[1])))
    return write_mp4(out / name, frames)


def summary(recordings: list[EpisodeRecording], checkpoints: list[Path], path: Path) -> str:
    outcomes = " | ".join(
        f"{label(checkpoint) + ': ' if len(recordings) > 1 else ''}{recording.outcome} in {recording.steps} steps"
        for recording, checkpoint in zip(recordings, checkpoints)
    )
    return f"{recordings[0].task} layout {recordings[0].layout_id}: {outcomes} -> {path}"


if __name__ == "__main__":
    sys.exit(main())
