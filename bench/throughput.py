"""The main job's whole-iteration env steps/s against the raw environment limit of the same machine, measured
one after the other in one run.

    nice -n 5 python bench/throughput.py                        # 12 iterations of the default job, 30 s of bare envs
    python bench/throughput.py --iterations 2 --warmup-iterations 1 --env-seconds 2 \\
        --main-arg=--allow-random-init --main-arg=--num-actors=2 --main-arg=--set=actors.decisions_per_rollout=5 \\
        --main-arg=--set=algorithm.minibatch_size=10 --main-arg=--set=algorithm.critic_warmup_iters=0  # a smoke run

- main job: `python -m learner.main` (the default config unless --main-arg says otherwise), once per
  actors.policy_lag of --policy-lags (0: synchronous; 1: sampling overlaps the update), for --iterations
  iterations with eval_every=0 (held-out evaluation only before the first and after the last iteration, outside
  the iteration times), --eval-episodes layouts, no dashboard, WANDB_MODE=disabled, in a temporary run dir. Its
  metrics.jsonl gives each iteration's env steps and wall time (sampling + update + weight publication); the first
  --warmup-iterations are left out. lag<L>_main_env_steps_per_second = their env steps / their seconds, and
  lag<L>_over_lag0 compares each lag with the synchronous loop of the same run.
- env limit: the bare `common.vector_env.ChunkedVectorEnv`, built as a rollout actor of the main job builds it (from the
  config learner.main resolves from the --main-arg arguments: its task, training layouts, gamma, actors.envs_per_actor
  envs), stepped with uniformly random chunks of the policy's chunk size, in one process per core, all started
  together, for --env-seconds. env_limit_steps_per_second = the sum over processes of env steps / seconds. No
  policy, no Ray: what the machine can step at all.
- lag<L>_ratio_to_env_limit = lag<L>_main_env_steps_per_second / env_limit_steps_per_second (the goal:
  >= 0.7).
- matched env limit: the same, in as many processes as the main job has actors (--matched-processes to change it).
  On a machine other jobs load, the scheduler shares the cores per process, so 2 bare processes get a smaller
  share than the main job's 11: the per-core limit then understates the machine and the ratio overstates the job.
  lag<L>_ratio_to_matched_env_limit holds the process count equal; on an idle machine the two limits should agree.
- RLlib (the peer figure, with --rllib-python): bench/rllib_ppo.py, RLlib's PPO on the same task with the
  main job's envs spread over one EnvRunner per core and its env steps per iteration, for the same --iterations and
  --warmup-iterations, run after the main job(s) by that interpreter. Its figures come in prefixed rllib_, and
  lag<L>_over_rllib = lag<L>_main_env_steps_per_second / rllib_env_steps_per_second (both whole iterations).
  RLlib 2.60 needs gymnasium 1.2.2, so it gets a virtual environment of its own, outside the repo:

    python -m venv /work/rllib-venv
    /work/rllib-venv/bin/pip install torch==2.13.0          # first: the CPU build stays
    /work/rllib-venv/bin/pip install "ray[rllib]==2.60.0" metaworld==3.1.1
    /work/rllib-venv/bin/pip install --no-deps -e .        # this repo, for common.suites
    nice -n 5 python bench/throughput.py --policy-lags 1 --rllib-python /work/rllib-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import operator
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import REPO_ROOT, emit, load_average, ratio
from common.config import RunConfig
from learner.main import parse_args, resolve_config


def step_bare_envs(config: RunConfig, seconds: float, seed: int, start: multiprocessing.synchronize.Barrier, results) -> None:
    """One process of the env limit: build the envs as a rollout actor of `config` does, wait for the others, step
    random chunks."""
    from common.rollout import env_tasks, group_tasks, make_envs
    from common.suites import make_suite
    from common.vector_env import ChunkedVectorEnv

    num_envs = config.actors.envs_per_actor
    suite = make_suite(config.env)
    tasks = env_tasks(group_tasks(suite.tasks(), num_envs), 0, num_envs)
    layouts = [layout for task in dict.fromkeys(tasks) for layout in suite.layouts(task, config.env.train_benchmark_seeds)]
    vec_env = ChunkedVectorEnv(make_envs(suite, tasks), layouts, config.algorithm.gamma)
    rng = np.random.default_rng(seed)
    low, high = vec_env.single_action_space.low, vec_env.single_action_space.high
    chunk_shape = (num_envs, config.policy.chunk_size, vec_env.single_action_space.shape[0])
    vec_env.reset(seed)
    start.wait()
    steps, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        steps += int(vec_env.step_chunk(rng.uniform(low, high, chunk_shape).astype(np.float32)).steps.sum())
    results.put((steps, elapsed))


def env_limit(config: RunConfig, processes: int, seconds: float, prefix: str = "env_limit") -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=step_bare_envs, args=(config, seconds, seed, start, results)) for seed in range(processes)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return {f"{prefix}_steps_per_second": sum(steps / elapsed for steps, elapsed in outcomes), f"{prefix}_processes": processes,
            f"{prefix}_envs_per_process": config.actors.envs_per_actor,
            f"{prefix}_env_steps": sum(steps for steps, _ in outcomes)}  # fmt: skip


def main_job(iterations: int, warmup: int, eval_episodes: int, extra_args: list[str], run_dir: Path | None = None,
             overlapped: bool = False) -> dict[str, float]:  # fmt: skip
    """The figures of one learner.main run; in `run_dir` when given (kept), else in a temporary directory.
    overlapped: the run samples while it updates (actors.policy_lag > 0)."""
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as scratch:
        run_dir = run_dir or Path(scratch) / "run"
        command = [sys.executable, "-m", "learner.main", "--iterations", str(iterations), "--set", "eval_every=0",
                   "--set", f"eval_episodes={eval_episodes}", "--no-dashboard", "--run-dir", str(run_dir), *extra_args]  # fmt: skip
        began = time.perf_counter()
        finished = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
        command_seconds = time.perf_counter() - began
        if finished.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({finished.returncode}):\n{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [row for row in rows if "time/iteration_seconds" in row and row["iteration"] > warmup]
    if not timed:
        raise RuntimeError(f"no iterations after the {warmup} warm-up ones in metrics.jsonl ({len(rows)} rows)")
    seconds = sum(row["time/iteration_seconds"] for row in timed)
    # At lag 0 the update follows the sampling; at lag > 0 they overlap, and the longer of the two is the iteration's path.
    critical_path = max if overlapped else operator.add
    cpu_keys = {"env": "time/actors_env_cpu_seconds", "policy": "time/actors_policy_cpu_seconds", "update": "time/update_cpu_seconds"}
    cpu = {part: sum(row[key] for row in timed) for part, key in cpu_keys.items()}
    return {
        "main_env_steps_per_second": sum(row["rollout/env_steps"] for row in timed) / seconds,
        "main_iterations_timed": len(timed),
        "main_median_iteration_seconds": statistics.median(row["time/iteration_seconds"] for row in timed),
        "main_median_sample_seconds": statistics.median(row["time/sample_seconds"] for row in timed),
        "main_median_update_seconds": statistics.median(row["time/update_seconds"] for row in timed),
        # The share of the timed iterations spent outside the slowest actor's sampling and the learner's update (each
        # measured where it runs; where they overlap, outside the longer of the two): scheduling, transfers, weight
        # publication, the driver's waits.
        "main_outside_work_share": 1
        - sum(critical_path(row["time/sample_seconds"], row["time/update_seconds"]) for row in timed) / seconds,
        # Shares of the CPU work (the actors' policy and envs, the learner's update). Where they all share the cores,
        # the env share is the highest ratio to the env limit this job could reach doing the same work per env step.
        **{f"main_{part}_cpu_share": cpu[part] / sum(cpu.values()) for part in cpu},
        "main_command_seconds": command_seconds,
    }


def check_rllib_python(path: str) -> None:
    """Refuse, before anything runs, an --rllib-python that is not an executable interpreter able to import RLlib and
    this repo's envs (a failure there would otherwise come after the main jobs' minutes)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--rllib-python {path}: no such file (the venv's python, e.g. /work/rllib-venv/bin/python; see --help)")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"--rllib-python {path}: not executable")
    try:
        probe = subprocess.run(
            [path, "-c", "import ray.rllib, common.suites.metaworld"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SystemExit(f"--rllib-python {path}: cannot run it ({error})") from error
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            f"--rllib-python {path} cannot import ray.rllib and common.suites.metaworld ({last}); install the venv as --help says"
        )


def rllib_job(python: str, iterations: int, warmup: int) -> dict:
    """bench/rllib_ppo.py's figures, run by `python` (its progress goes to this process's stderr)."""
    command = [python, str(REPO_ROOT / "bench" / "rllib_ppo.py"), "--iterations", str(iterations), "--warmup-iterations", str(warmup)]
    began = time.perf_counter()
    finished = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({finished.returncode}):\n{finished.stdout[-3000:]}")
    lines = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(command)} printed no JSON line:\n{finished.stdout[-3000:]}")
    return {**json.loads(lines[0]), "rllib_command_seconds": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12, help="main-job iterations")
    parser.add_argument("--warmup-iterations", type=int, default=2, help="first main-job iterations left out of the figure")
    parser.add_argument("--eval-episodes", type=int, default=10, help="held-out layouts of the main job's evaluations (outside the figure)")
    parser.add_argument("--env-seconds", type=float, default=30.0, help="seconds of bare env stepping per process")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="bare-env processes (default: one per core)")
    parser.add_argument("--matched-processes", type=int, help="a second env limit in this many processes (default: as many as the "
                        "main job has actors; 0: skip)")  # fmt: skip
    parser.add_argument("--policy-lags", default="0,1", help="actors.policy_lag of each main-job run, comma-separated")
    parser.add_argument("--main-arg", action="append", default=[], help="extra argument for learner.main (repeatable)")
    parser.add_argument("--rllib-python", default="", help="the RLlib venv's python: run bench/rllib_ppo.py with it too (default: not run)")
    args = parser.parse_args(argv)
    lags = [int(lag) for lag in args.policy_lags.split(",")]
    if args.iterations <= args.warmup_iterations or args.warmup_iterations < 0:
        raise SystemExit(f"--iterations ({args.iterations}) must exceed --warmup-iterations ({args.warmup_iterations}) >= 0")
    if args.env_seconds <= 0 or args.processes < 1:
        raise SystemExit("--env-seconds must be > 0 and --processes >= 1")
    if args.rllib_python:
        check_rllib_python(args.rllib_python)
    # The main job's config, as learner.main resolves it: the env limit steps the same task with its envs per actor.
    job_config = resolve_config(parse_args(args.main_arg))
    matched_processes = job_config.actors.num_actors if args.matched_processes is None else args.matched_processes
    results: dict = {"bench": "throughput", "load_average_1m_start": load_average()}
    for lag in lags:
        job = main_job(args.iterations, args.warmup_iterations, args.eval_episodes, [*args.main_arg, f"--set=actors.policy_lag={lag}"],
                       overlapped=lag > 0)  # fmt: skip
        results.update({f"lag{lag}_{key}": value for key, value in job.items()})
    if args.rllib_python:
        results.update(rllib_job(args.rllib_python, args.iterations, args.warmup_iterations))
    limits = ["env_limit"]
    results.update(env_limit(job_config, args.processes, args.env_seconds))
    if matched_processes > 0:
        limits.append("matched_env_limit")
        results.update(env_limit(job_config, matched_processes, args.env_seconds, prefix="matched_env_limit"))
    for lag in lags:
        speed = results[f"lag{lag}_main_env_steps_per_second"]
        for limit in limits:
            results[f"lag{lag}_ratio_to_{limit}"] = ratio(speed, results[f"{limit}_steps_per_second"])
        if lag != 0 and 0 in lags:
            results[f"lag{lag}_over_lag0"] = ratio(speed, results["lag0_main_env_steps_per_second"])
        if args.rllib_python:
            results[f"lag{lag}_over_rllib"] = ratio(speed, results["rllib_env_steps_per_second"])
    results["load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
