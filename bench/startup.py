"""Start-up: the main command to its first rollout with 10 actors, against a floor measured in the same run.

    nice -n 5 python bench/startup.py                             # 10 actors, the default job
    python bench/startup.py --actors 2 --main-arg=--allow-random-init --main-arg=--set=actors.decisions_per_rollout=2 \\
        --main-arg=--set=algorithm.minibatch_size=4                 # a smoke run

- main command: `python -m learner.main --single-batch --num-actors N --no-dashboard` in a temporary run dir
  (WANDB_MODE=disabled): the real start-up (config, Ray, learner and N rollout actors building their envs and
  policies, the first rollout) then one update. --single-batch skips the held-out evaluation before the first
  iteration, which the default command runs and which is an evaluation cost, not a start-up one. The bench
  times the subprocess from launch until its first metrics.jsonl row appears and subtracts that row's
  time/update_seconds: command_to_first_rollout_seconds, which still holds the weight publication and the
  checkpoint the single batch saves (tens of milliseconds for the MLP policy).
- main_stages: where the main command's start-up went, from its summary.json ("startup", learner.runtime.startup.STARTUP_STAGES):
  seconds since learner.main.run began (the interpreter's start and learner.main's imports come before) at which
  Ray was up, the input checked, the learner and all the actors constructed, the weights published and the first
  rollout collected.
- main_console_lines_before_its_own / main_console_error_lines: what a user sees first, from the command's console
  (stdout and stderr in the order written): the lines before the project's own first one ("[start] flowrl: ..."), and
  the lines printed at an error level (Ray's "E" C++ log lines, Python's ERROR records).
- floor: in this process, `ray.init` (local, no dashboard) plus N bare actors whose constructor imports torch,
  until all N have answered; then Ray is shut down. It runs after the main command, so it meets file caches at
  least as warm. floor_stages: when Ray was up and when the actors had answered, in seconds since ray.init began.
- ratio_to_floor = command_to_first_rollout_seconds / floor_seconds (the goal: within 1.3). Side by side, by
  stage: ray_up_ratio (the main command's Ray start, beside its input checks, against the bare one) and
  after_ray_ratio (from Ray up to the first rollout, against the floor's from Ray up to its actors' answers).
- main_cpu_seconds / floor_cpu_seconds: the CPU seconds each spent until its end point above, by process kind
  (actors, learner, driver, other: Ray's own processes and tasks), read from /proc every 0.2 s
  (bench.report.ProcessTreeCPU; Linux only); cpu_ratio_to_floor compares their totals. Where start-up is CPU-bound
  (more processes than cores) the wall-time ratio follows this one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import REPO_ROOT, ProcessTreeCPU, emit, load_average, ratio

# A console line at an error level: Ray's C++ log ("[2026-01-01 00:00:00,000 E 123 456] file.cc:1: ...") or a Python
# logging record at ERROR.
ERROR_LINE = re.compile(r"^\[\S+ \S+ E \d+ \d+\]|\bERROR\b")


def process_kind(root_pid: int) -> Callable[[int, str], str | None]:
    """kind_of for ProcessTreeCPU: "driver" (the main command's process, or this bench's for the floor), "actors"
    (rollout or bare), "learner", "other" (Ray's own processes and tasks); None for a Ray worker not yet given work."""

    def kind_of(pid: int, title: str) -> str | None:
        if pid == root_pid:
            return "driver"
        if not title or title.startswith("ray::IDLE"):
            return None
        name = title.removeprefix("ray::").split(" ")[0].split(".")[0] if title.startswith("ray::") else ""
        return {"RolloutActor": "actors", "BareActor": "actors", "LearnerActor": "learner"}.get(name, "other")

    return kind_of


def cpu_seconds(tree: ProcessTreeCPU) -> dict[str, float]:
    """CPU seconds by kind, with every kind named (0 when absent) and their total."""
    by_kind = {kind: 0.0 for kind in ("actors", "learner", "driver", "other")} | tree.by_kind()
    by_kind = {kind: round(cpu, 2) for kind, cpu in by_kind.items()}  # /proc counts clock ticks (10 ms)
    return {**by_kind, "total": round(sum(by_kind.values()), 2)}


class BareActor:
    """The least a rollout actor is: a Ray worker process that has imported torch."""

    def __init__(self) -> None:
        import torch

        self.threads = torch.get_num_threads()

    def ready(self) -> int:
        return os.getpid()


def floor_stages(actors: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds since ray.init began: Ray up ("ray_up"), and all the bare actors answered ("actors_ready"); and the CPU
    seconds this process and Ray's spent until then, by kind."""
    import ray

    from learner.runtime.ray_runtime import start_local_ray

    try:
        with ProcessTreeCPU(os.getpid(), process_kind(os.getpid())) as tree:  # its last reading comes before Ray's shutdown
            began = time.perf_counter()
            start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
            ray_up = time.perf_counter() - began
            handles = [ray.remote(BareActor).options(num_cpus=0).remote() for _ in range(actors)]
            ray.get([handle.ready.remote() for handle in handles])
            stages = {"ray_up": ray_up, "actors_ready": time.perf_counter() - began}
    finally:
        ray.shutdown()
    return stages, cpu_seconds(tree)


def main_command_seconds(actors: int, extra_args: list[str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as run_dir:
        metrics_path = Path(run_dir) / "metrics.jsonl"
        log_path = Path(run_dir) / "console.log"
        command = [sys.executable, "-m", "learner.main", "--single-batch", "--num-actors", str(actors), "--no-dashboard",
                   "--run-dir", run_dir, *extra_args]  # fmt: skip
        with open(log_path, "w") as log:
            began = time.perf_counter()
            environment = {**os.environ, "WANDB_MODE": "disabled"}
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
            first_row_seconds = None
            with ProcessTreeCPU(process.pid, process_kind(process.pid)) as tree:  # until the first metrics row
                while process.poll() is None and time.perf_counter() - began < timeout_s:
                    if metrics_path.exists() and metrics_path.read_text().strip():
                        first_row_seconds = time.perf_counter() - began
                        break
                    time.sleep(0.02)
            try:
                process.wait(timeout=max(0.0, timeout_s - (time.perf_counter() - began)))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise RuntimeError(f"{' '.join(command)} ran past {timeout_s} s") from None
            command_seconds = time.perf_counter() - began
        if process.returncode != 0 or first_row_seconds is None:
            raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}, metrics row seen: {first_row_seconds is not None}):\n"
                               f"{log_path.read_text()[-4000:]}")  # fmt: skip
        console = log_path.read_text().splitlines()
        own = next((number for number, line in enumerate(console) if line.startswith("[start] flowrl:")), len(console))
        errors = [line for line in console if ERROR_LINE.search(line)]
        first_row = json.loads(metrics_path.read_text().splitlines()[0])
        stages = json.loads((Path(run_dir) / "summary.json").read_text())["startup"]
    return {
        "command_to_first_rollout_seconds": first_row_seconds - first_row["time/update_seconds"],
        "command_to_first_metrics_row_seconds": first_row_seconds,
        "first_rollout_sample_seconds": first_row["time/sample_seconds"],
        "command_seconds": command_seconds,
        "main_stages": stages,
        "main_console_lines_before_its_own": own,
        "main_console_error_lines": len(errors),
        "main_cpu_seconds": cpu_seconds(tree),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, default=10, help="rollout actors (and bare actors of the floor)")
    parser.add_argument("--main-arg", action="append", default=[], help="extra argument for learner.main (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the main command may take")
    args = parser.parse_args(argv)
    if args.actors < 1:
        raise SystemExit(f"--actors must be >= 1, got {args.actors}")
    results: dict = {"bench": "startup", "actors": args.actors, "load_average_1m_start": load_average()}
    results.update(main_command_seconds(args.actors, args.main_arg, args.timeout))
    main_stages = results["main_stages"]
    floor, floor_cpu = floor_stages(args.actors)
    results.update({"floor_stages": floor, "floor_cpu_seconds": floor_cpu})
    results["cpu_ratio_to_floor"] = ratio(results["main_cpu_seconds"]["total"], results["floor_cpu_seconds"]["total"])
    results["floor_seconds"] = floor["actors_ready"]
    results["ratio_to_floor"] = ratio(results["command_to_first_rollout_seconds"], results["floor_seconds"])
    results["ray_up_ratio"] = ratio(main_stages["ray_up"], floor["ray_up"])
    results["after_ray_ratio"] = ratio(main_stages["first_rollout"] - main_stages["ray_up"], floor["actors_ready"] - floor["ray_up"])
    results["load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
