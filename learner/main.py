"""The command line: `python -m learner.main --num-actors 10`.

Resolves the config (embedded defaults, `--config`, `--set`, flags), refuses bad input before anything is
written (learner.runtime.startup.preflight, checked while Ray starts), takes the run directory (learner.files.run_dir), and
hands over to the training loop in learner.runtime.driver. Importing this module brings in Ray but not torch or the envs,
so that Ray's start-up can overlap theirs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from common.config import ConfigError, RunConfig
from common.config_loading import fields_of, load_config
from common.console import log
from learner.runtime.cluster_yaml import check_cluster
from learner.runtime.failures import handle_stop_signals, stop_exit_code, stop_on_signal
from learner.runtime.ray_runtime import cluster_to_join, connect_ray

__all__ = ["main", "run"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.main", description="Ray actor/learner PPO fine-tuning of a flow policy.")
    parser.add_argument(
        "--config",
        action="append",
        help="YAML run config (default: the embedded defaults = configs/pick_place.yaml); "
        "repeatable: each file's fields over the earlier ones' (a recipe, then a cluster's resources and paths)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override any config field (repeatable)")
    parser.add_argument("--num-actors", type=int, help="rollout actors (actors.num_actors)")
    parser.add_argument("--iterations", type=int, help="PPO iterations (iterations)")
    parser.add_argument("--algo", choices=("ppo", "grpo"), help="ppo (critic, GAE) or grpo (critic-free, group-relative) (algorithm.algo)")
    parser.add_argument("--seed", type=int, help="run seed")
    parser.add_argument("--run-dir", help="where checkpoints, metrics and the curve go (run_dir)")
    parser.add_argument("--checkpoint", help="policy directory to fine-tune (default: the cached BC checkpoint)")
    parser.add_argument(
        "--allow-random-init", action="store_true", help="fine-tune a randomly initialised policy (almost always a mistake)"
    )
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--resume", action="store_true", help="continue from run_dir's latest checkpoint")
    parser.add_argument(
        "--allow-config-change",
        action="append",
        default=[],
        metavar="FIELD",
        help="with --resume: accept a config that differs from the run's in FIELD (repeatable)",
    )
    parser.add_argument("--single-batch", action="store_true", help="one rollout and one update, printing every intermediate quantity")
    parser.add_argument("--no-dashboard", action="store_true", help="start local Ray without its dashboard")
    parser.add_argument(
        "--check-cluster",
        metavar="CLUSTER_YAML",
        help="check a Ray cluster YAML against this run config offline, print the planned placement, exit",
    )
    return parser.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.set)
    for flag, key in (
        ("num_actors", "actors.num_actors"),
        ("iterations", "iterations"),
        ("seed", "seed"),
        ("run_dir", "run_dir"),
        ("checkpoint", "init_checkpoint"),
        ("algo", "algorithm.algo"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    if args.allow_random_init:
        overrides.append("allow_random_init=true")
    if args.single_batch:
        overrides += ["iterations=1", "algorithm.update_epochs=1", "algorithm.critic_warmup_iters=0"]
    return load_config(args.config, overrides)


def run(
    config: RunConfig,
    *,
    resume: bool = False,
    allow_config_change: frozenset[str] = frozenset(),
    address: str | None = None,
    include_dashboard: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Train; returns the summary (also written to run_dir/summary.json). The run holds its directory throughout.

    Ray starts while the input is checked (learner.runtime.startup.preflight): importing it brings in torch, the
    policies and the envs, seconds that would otherwise come before Ray's own seconds of start-up. Bad input still
    stops the run before its directory is created or touched, and a Ray started here is shut down when the run
    fails."""
    began = time.perf_counter()
    startup: dict[str, float] = {}  # stage -> seconds since `began` (learner.runtime.startup.STARTUP_STAGES)
    connected_here = False
    try:
        # Before the input checks start: an address nothing answers at is refused at once, not after them.
        on_a_ray_already = ray.is_initialized()
        joining = None if on_a_ray_already else cluster_to_join(address)
        ray_line = "this process's Ray" if on_a_ray_already else f"joining Ray at {joining}" if joining else "starting a local Ray"
        log.info(f"[start] flowrl: {'resuming' if resume else 'a new run in'} {config.run_dir}; {ray_line} while the input is checked")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as checking:
            checked = checking.submit(check_input, config, address, resume)
            checked.add_done_callback(lambda _: startup.setdefault("input_checked", time.perf_counter() - began))
            on_sigterm = signal.getsignal(signal.SIGTERM)
            connected_here = connect_ray(joining, include_dashboard)
            if on_sigterm is stop_on_signal:  # ray.init installs a handler of its own, which logs errors and aborts
                signal.signal(signal.SIGTERM, stop_on_signal)
            startup["ray_up"] = time.perf_counter() - began
            eval_layouts = checked.result()
        if joining or on_a_ray_already:  # a local Ray this run started is one node, whose files preflight has checked
            from learner.files.node_files import check_every_node_holds, paths_every_node_reads

            check_every_node_holds(paths_every_node_reads(config))  # a cluster's nodes: each holds what the config names
        from learner.files.run_dir import RunDirectory
        from learner.runtime.driver import train

        directory = RunDirectory(config.run_dir)
        if resume:
            directory.latest_checkpoint()  # a directory with nothing to resume is refused before it is locked (created)
        with directory.locked():
            resume_dir = directory.resume(config, allow_config_change) if resume else None
            if not resume:
                directory.start_new(config)
            return train(config, directory, resume_dir, eval_layouts, began=began, startup=startup, **options)
    except BaseException:
        if connected_here:  # not a Ray the caller had started
            ray.shutdown()
        raise


def check_input(config: RunConfig, address: str | None, resume: bool) -> list:
    """learner.runtime.startup.preflight, imported here: in run's checking thread, beside Ray's start."""
    from learner.runtime.startup import preflight

    return preflight(config, address, resume)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        log.error(f"config error: {exc}")
        return 2
    if args.check_cluster:  # offline: no Ray is started
        try:
            log.info(check_cluster(args.check_cluster, config))
        except ConfigError as exc:
            log.error(f"cluster config error: {exc}")
            return 2
        return 0
    unknown = sorted(set(args.allow_config_change) - fields_of(config))
    if unknown:
        log.error(f"error: --allow-config-change names no config field: {unknown}")
        return 2
    handle_stop_signals()  # SIGTERM saves a checkpoint like Ctrl-C (run keeps its handler once Ray is up)
    try:
        run(
            config,
            resume=args.resume,
            allow_config_change=frozenset(args.allow_config_change),
            single_batch=args.single_batch,
            address=args.address,
            include_dashboard=not args.no_dashboard,
        )
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM, the run's progress saved
        return stop_exit_code(stop)
    except ConfigError as exc:  # bad input: a clear message, no traceback, nothing written
        log.error(f"error: {exc}")
        return 2
    except Exception as exc:
        # Imported only now (run imported them already): importing them up front would bring torch and the envs in
        # before run() starts Ray, the very seconds run() overlaps.
        from common.diagnostics import RandomInitError
        from common.policy import CheckpointError, CheckpointWriteError
        from learner.runtime.failures import ActorsExhaustedError, LearnerDiedError

        if isinstance(exc, (CheckpointError, RandomInitError, FileExistsError, FileNotFoundError)):
            log.error(f"error: {exc}")  # bad input too
            return 2
        if isinstance(exc, (ActorsExhaustedError, LearnerDiedError, CheckpointWriteError)):
            # An error of the learner's arrives as Ray's RayTaskError, whose text is the remote traceback: its cause is the error.
            log.error(f"error: {getattr(exc, 'cause', exc)}; the latest checkpoint is kept: continue with --resume")
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
