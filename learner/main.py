"""The driver: `python -m learner.main --num-actors 10`.

Orchestration only: resolve the config, start or join Ray, build the learner and the rollout actors,
then loop (sample -> update -> broadcast -> evaluate/checkpoint/log). The math lives in common/, the
optimisation in learner/learner.py, the sampling in actors/.

Weights flow one way as versioned state (one `ray.put` per version by the learner, every actor reads
the same reference); rollouts flow the other way as typed numpy records, straight from the actors into
the learner (their object refs are passed to the learner's update, not through the driver).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import yaml

from actors.rollout_actor import RolloutActor
from common.config import ConfigError, RunConfig, load_config
from common.diagnostics import RandomInitError, check_ratio_sensitivity
from common.envs import layouts
from common.flow import num_log_prob_elements
from common.metrics import MetricsLog, console_line, eval_metrics, plot_learning_curve, rollout_metrics
from common.policy import WEIGHTS_FILE, CheckpointError, FlowPolicy, build_policy
from common.trajectory import RolloutBatch
from learner.cluster import (
    FIRST_ACTOR_BUNDLE,
    LEARNER_BUNDLE,
    actor_request,
    check_cluster,
    learner_request,
    node_cluster_address,
    start_local_ray,
)
from learner.learner import Learner
from learner.manifest import file_sha256, reproducibility_manifest
from learner.monitoring import GaugeExporter, actor_health, per_actor_metrics
from learner.pretrain import REPORT_FILE, ensure_bc_checkpoint
from learner.run_dir import RunDirectory, fields_of


class LearnerActor:
    """Ray actor around Learner: gathers rollouts, updates, publishes weights, checkpoints, exports gauges."""

    def __init__(self, config: RunConfig, checkpoint_dir: str | None, resume_dir: str | None):
        torch.manual_seed(config.seed)
        if resume_dir or checkpoint_dir:
            policy = FlowPolicy.from_pretrained(resume_dir or checkpoint_dir, **config.policy.sampling_overrides())
        else:
            policy = build_policy(config.policy)  # Learner refuses it unless allow_random_init
        # A GPU (learner.num_gpus > 0) makes Ray set CUDA_VISIBLE_DEVICES for this actor; the learner stays float32.
        policy.to("cuda" if config.learner.num_gpus > 0 and torch.cuda.is_available() else "cpu")
        self.learner = Learner(config, policy)
        if resume_dir is not None:
            self.learner.load_trainer_state(resume_dir)
        self.gauges = GaugeExporter(config.env.task)

    def progress(self) -> tuple[int, int]:
        """(completed iterations, env steps trained on), both restored from the checkpoint on resume."""
        return self.learner.iteration, self.learner.env_steps

    def update(self, *batches: RolloutBatch, verbose: bool = False) -> dict[str, float]:
        for batch in batches:
            batch.validate()
        batch = RolloutBatch.concat(list(batches))
        version_before = self.learner.version
        start = time.perf_counter()
        metrics = self.learner.update(batch, verbose=verbose)
        metrics.update(rollout_metrics(batch, version_before))
        metrics.update(per_actor_metrics(batches, version_before))
        metrics["time/update_seconds"] = time.perf_counter() - start
        return metrics

    def publish(self) -> list[ray.ObjectRef]:
        """ONE ray.put per weight version; wrapped in a list so Ray hands the driver the reference itself."""
        return [ray.put(self.learner.broadcast())]

    def save(self, directory: str) -> str:
        return str(self.learner.save_checkpoint(directory))

    def export_gauges(self, metrics: dict[str, float]) -> None:
        """Publish every numeric metric as a tagged ray.util.metrics Gauge (Ray dashboard / Prometheus)."""
        self.gauges.export(metrics)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.main", description="Ray actor/learner PPO fine-tuning of a flow policy.")
    parser.add_argument("--config", help="YAML run config (default: the embedded defaults = configs/pick_place.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override any config field (repeatable)")
    parser.add_argument("--num-actors", type=int, help="rollout actors (actors.num_actors)")
    parser.add_argument("--iterations", type=int, help="PPO iterations (iterations)")
    parser.add_argument("--algo", choices=("ppo", "grpo"), help="ppo (critic, GAE) or grpo (critic-free, group-relative) (learner.algo)")
    parser.add_argument("--seed", type=int, help="run seed")
    parser.add_argument("--run-dir", help="where checkpoints, metrics and the curve go (run_dir)")
    parser.add_argument("--checkpoint", help="policy directory to fine-tune (default: the cached BC checkpoint)")
    parser.add_argument(
        "--allow-random-init", action="store_true", help="fine-tune a randomly initialised policy (almost always a mistake)"
    )
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--resume", action="store_true", help="continue from run_dir's latest checkpoint")
    parser.add_argument("--allow-config-change", action="append", default=[], metavar="FIELD",
                        help="with --resume: accept a config that differs from the run's in FIELD (repeatable)")  # fmt: skip
    parser.add_argument("--single-batch", action="store_true", help="one rollout and one update, printing every intermediate quantity")
    parser.add_argument("--no-dashboard", action="store_true", help="start local Ray without its dashboard")
    parser.add_argument("--check-cluster", metavar="CLUSTER_YAML",
                        help="check a Ray cluster YAML against this run config offline, print the planned placement, exit")  # fmt: skip
    return parser.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.set)
    for flag, key in (("num_actors", "actors.num_actors"), ("iterations", "iterations"), ("seed", "seed"), ("run_dir", "run_dir"),
                      ("checkpoint", "init_checkpoint"), ("algo", "learner.algo")):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    if args.allow_random_init:
        overrides.append("allow_random_init=true")
    if args.single_batch:
        overrides += ["iterations=1", "learner.update_epochs=1", "learner.critic_warmup_iters=0"]
    return load_config(args.config, overrides)


def banner(config: RunConfig, checkpoint: Path | None, resume_dir: Path | None, resources: dict[str, float], cpus_per_actor: float) -> str:
    lines = ["=" * 78, "flowrl: ReinFlow-style PPO fine-tuning of a flow policy", "=" * 78]
    lines.append(yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip())
    lines.append("-" * 78)
    lines.append(f"config fingerprint : {config.fingerprint()}")
    lines.append(f"ray resources      : {resources}")
    lines.append(f"  per actor        : {cpus_per_actor:.4g} CPU, {config.actors.num_gpus} GPU, custom {config.actors.resources}")
    lines.append(f"  learner          : {config.learner.num_gpus} GPU, custom {config.learner.resources}")
    if checkpoint is not None:
        lines.append(f"init checkpoint    : {checkpoint} (sha256 {file_sha256(checkpoint / WEIGHTS_FILE)[:16]})")
        report = checkpoint / REPORT_FILE
        if report.is_file():
            data = json.loads(report.read_text())
            lines.append(
                f"  pre-training     : {data['demos']} demos, held-out success {data['eval_success_rate']:.2f} ({data['eval_layouts']})"
            )
    if resume_dir is not None:
        lines.append(f"resuming from      : {resume_dir}")
    p = config.policy
    lines.append(
        f"log-prob           : {p.log_prob_normalization} over {p.num_steps} steps x {p.chunk_size}x{p.action_dim} elements;"
        f" sigma in [{p.sigma_min}, {p.sigma_max}]; clip {config.learner.clip_eps}"
    )
    lines.append("=" * 78)
    return "\n".join(lines)


def evaluate(actors: list, weights_ref: ray.ObjectRef, eval_layouts: list) -> tuple[np.ndarray, set[int]]:
    """Deterministic held-out evaluation, the layouts split across actors; returns successes and versions used."""
    groups = np.array_split(np.arange(len(eval_layouts)), len(actors))
    calls = [actor.evaluate.remote(weights_ref, [eval_layouts[i] for i in group]) for actor, group in zip(actors, groups) if len(group)]
    results = ray.get(calls)
    return np.concatenate([r[1] for r in results]), {r[0] for r in results}


def init_wandb(config: RunConfig, run_dir: Path, resume: bool):
    os.environ.setdefault("WANDB_MODE", "offline")  # offline by default; WANDB_MODE=online/disabled respected
    if os.environ["WANDB_MODE"] == "disabled":
        return None
    import wandb

    run_id_file = run_dir / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if resume and run_id_file.is_file() else None
    run = wandb.init(project=config.wandb_project, dir=str(run_dir), config=config.to_dict(), id=run_id, resume="allow" if run_id else None)
    run_id_file.write_text(run.id)
    return run


def resolve_init_checkpoint(config: RunConfig) -> Path | None:
    """The policy directory to fine-tune: the configured one, else the cached BC checkpoint (built on first use)."""
    if config.init_checkpoint is None:
        return None if config.allow_random_init else ensure_bc_checkpoint(config)
    checkpoint = Path(config.init_checkpoint)
    if not (checkpoint / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"init checkpoint {checkpoint} has no {WEIGHTS_FILE}: expected a directory written by save_pretrained")
    return checkpoint


def start_workers(
    config: RunConfig, checkpoint: Path | None, resume_dir: Path | None, address: str | None, include_dashboard: bool
) -> tuple[Any, list[Any]]:
    """Start or join Ray, print the banner, and bring up the learner and the rollout actors."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or node_cluster_address()  # on a cluster node: join it
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            start_local_ray(include_dashboard=include_dashboard, log_to_driver=True)
    resources = ray.cluster_resources()
    node_cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]]
    learner_resources, actor_resources = learner_request(config, sum(node_cpus)), actor_request(config, node_cpus)
    for section, request in (("learner", learner_resources), ("actors", actor_resources)):
        missing = {k: v for k, v in request.amounts().items() if k != "CPU" and resources.get(k, 0) < v}
        if missing:  # Ray would leave the actor pending forever
            raise ConfigError(f"{section} asks for {missing} ({section}.num_gpus / {section}.resources) but the Ray cluster "
                              f"offers {resources}: change them, or start nodes that declare them (cluster YAML min_workers)")  # fmt: skip
    cpus_per_actor = actor_resources.num_cpus
    print(banner(config, checkpoint, resume_dir, resources, cpus_per_actor), flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        check_ratio_sensitivity(num_log_prob_elements(build_policy(config.policy)), config.policy.sigma_min,
                                config.policy.log_prob_normalization, config.learner.clip_eps)  # fmt: skip

    learner = (
        ray.remote(LearnerActor)
        .options(**learner_resources.options(bundle_index=LEARNER_BUNDLE))
        .remote(config, None if checkpoint is None else str(checkpoint), None if resume_dir is None else str(resume_dir))
    )
    actor_checkpoint = str(resume_dir or checkpoint) if (resume_dir or checkpoint) else None
    if actor_checkpoint is None:  # random-init run: actors start from the learner's random weights, saved for them
        actor_checkpoint = ray.get(learner.save.remote(str(Path(config.run_dir) / "checkpoints" / "random_init")))
    remote_actor = ray.remote(RolloutActor)
    actors = [
        remote_actor.options(**actor_resources.options(bundle_index=FIRST_ACTOR_BUNDLE + i), max_restarts=config.actors.max_restarts)
        .remote(config, i, actor_checkpoint)
        for i in range(config.actors.num_actors)
    ]
    ray.get([actor.pid.remote() for actor in actors])  # wait until every actor is up: timings start clean
    return learner, actors


def run(config: RunConfig, *, resume: bool = False, allow_config_change: frozenset[str] = frozenset(), **options: Any) -> dict[str, Any]:
    """Train; returns the summary (also written to run_dir/summary.json). The run holds its directory throughout."""
    directory = RunDirectory(config.run_dir)
    with directory.locked():
        resume_dir = directory.resume(config, allow_config_change) if resume else None
        if not resume:
            directory.start_new(config)
        return train(config, directory, resume_dir, **options)


def train(config: RunConfig, directory: RunDirectory, resume_dir: Path | None, *, single_batch: bool = False, address: str | None = None,
          include_dashboard: bool = True) -> dict[str, Any]:  # fmt: skip
    wall_start = time.perf_counter()
    run_dir = directory.path
    resume = resume_dir is not None
    # A resumed run loads everything from its own checkpoint: never rebuild or re-read the initial one.
    checkpoint = None if resume_dir else resolve_init_checkpoint(config)

    eval_layouts = layouts(config.env.task, config.env.eval_benchmark_seeds)[: config.eval_episodes]
    if len(eval_layouts) < config.eval_episodes:
        raise ConfigError(f"eval_episodes={config.eval_episodes} but env.eval_benchmark_seeds give only {len(eval_layouts)} layouts")

    learner, actors = start_workers(config, checkpoint, resume_dir, address, include_dashboard)
    start_iteration, total_env_steps = ray.get(learner.progress.remote())
    weights_ref = ray.get(learner.publish.remote())[0]
    print(f"[start] {len(actors)} rollout actors and the learner up in {time.perf_counter() - wall_start:.1f}s", flush=True)

    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    wandb_run = None if single_batch else init_wandb(config, run_dir, resume)
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if resume and summary_path.is_file() else {}

    def run_eval(label: str) -> dict[str, float]:
        t0 = time.perf_counter()
        successes, versions = evaluate(actors, weights_ref, eval_layouts)
        result = eval_metrics(successes, eval_layouts)
        print(f"[eval:{label}] held-out {format_eval(result)}, weights v{sorted(versions)}, {time.perf_counter() - t0:.1f}s", flush=True)
        return result

    if start_iteration == 0:  # a resumed run keeps the manifest of the run it continues
        summary["manifest"] = reproducibility_manifest(config, checkpoint, eval_layouts)
    if start_iteration == 0 and not single_batch:
        summary["initial_eval"] = run_eval("initial policy")
        summary_path.write_text(json.dumps(summary, indent=2))  # kept if the run is interrupted
    last_saved = start_iteration
    iteration = start_iteration
    try:
        for iteration in range(start_iteration, config.iterations):
            t0 = time.perf_counter()
            sample_refs = [actor.sample.remote(weights_ref, iteration) for actor in actors]
            metrics = ray.get(learner.update.remote(*sample_refs, verbose=single_batch))
            weights_ref = ray.get(learner.publish.remote())[0]
            iteration_seconds = time.perf_counter() - t0
            total_env_steps += int(metrics["rollout/env_steps"])
            metrics.update({"iteration": iteration + 1, "rollout/total_env_steps": total_env_steps,
                            "time/iteration_seconds": iteration_seconds,
                            "time/env_steps_per_second": metrics["rollout/env_steps"] / iteration_seconds,
                            "time/wall_seconds": time.perf_counter() - wall_start})  # fmt: skip
            done = iteration + 1 == config.iterations
            if not single_batch and (done or (config.eval_every and (iteration + 1) % config.eval_every == 0)):
                metrics.update(run_eval(f"iteration {iteration + 1}"))
            if done or (iteration + 1) % config.checkpoint_every == 0:
                name = f"iter_{iteration + 1:06d}"
                ray.get(learner.save.remote(str(run_dir / "checkpoints" / name)))
                directory.write_latest(name)
                last_saved = iteration + 1
            metrics.update(actor_health(actors))
            metrics_log.write(metrics)
            learner.export_gauges.remote(metrics)
            if wandb_run is not None:
                wandb_run.log(metrics, step=iteration + 1)
            print(console_line(metrics), flush=True)
            if single_batch:
                print(json.dumps(metrics, indent=1, sort_keys=True), flush=True)
    except KeyboardInterrupt:
        completed, _ = ray.get(learner.progress.remote())
        if completed > last_saved:
            name = f"iter_{completed:06d}"
            ray.get(learner.save.remote(str(run_dir / "checkpoints" / name)))
            directory.write_latest(name)
            print(f"\n[interrupted] saved {name}; continue with --resume", flush=True)
        raise

    rows = metrics_log.read()
    final_eval = {k: rows[-1][k] for k in rows[-1] if k.startswith("eval/")} if rows else {}
    summary.update({"iterations": config.iterations, "env_steps": total_env_steps, "final_eval": final_eval,
                    "wall_seconds_this_session": time.perf_counter() - wall_start, "config_fingerprint": config.fingerprint(),
                    "init_checkpoint": str(checkpoint) if checkpoint else summary.get("init_checkpoint")})  # fmt: skip
    if "initial_eval" in summary and final_eval:
        summary["success_gain"] = final_eval["eval/success_rate"] - summary["initial_eval"]["eval/success_rate"]
    summary_path.write_text(json.dumps(summary, indent=2))
    if rows and not single_batch:
        summary["curve"] = str(
            plot_learning_curve(
                rows,
                run_dir / "learning_curve.png",
                f"{config.env.task}: {config.learner.algo.upper()} fine-tuning",
                summary.get("initial_eval"),
            )
        )
        print_summary(summary)
    if wandb_run is not None:
        wandb_run.finish()
    return summary


def format_eval(result: dict[str, float]) -> str:
    return (
        f"success {result['eval/success_rate']:.3f} (95% CI {result['eval/success_low']:.3f}-{result['eval/success_high']:.3f})"
        f" on {int(result['eval/episodes'])} layouts"
    )


def print_summary(summary: dict[str, Any]) -> None:
    print("=" * 78)
    initial, final = summary.get("initial_eval"), summary.get("final_eval")
    if initial:
        print(f"initial policy : {format_eval(initial)}")
    if final:
        print(f"after RL       : {format_eval(final)}")
    if "success_gain" in summary:
        print(f"gain           : {summary['success_gain']:+.3f} on the same {int(final['eval/episodes'])} held-out layouts")
    print(f"env steps      : {summary['env_steps']}, wall {summary['wall_seconds_this_session']:.0f}s; curve: {summary.get('curve')}")
    print("=" * 78, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.check_cluster:  # offline: no Ray is started
        try:
            print(check_cluster(args.check_cluster, config))
        except ConfigError as exc:
            print(f"cluster config error: {exc}", file=sys.stderr)
            return 2
        return 0
    unknown = sorted(set(args.allow_config_change) - fields_of(config))
    if unknown:
        print(f"error: --allow-config-change names no config field: {unknown}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM saves a checkpoint like Ctrl-C
    try:
        run(config, resume=args.resume, allow_config_change=frozenset(args.allow_config_change), single_batch=args.single_batch,
            address=args.address, include_dashboard=not args.no_dashboard)  # fmt: skip
    except KeyboardInterrupt:
        return 130
    except (ConfigError, CheckpointError, RandomInitError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # bad input: a clear message, no traceback, nothing written
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
