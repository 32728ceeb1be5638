"""Decisions per second of 1, 2, 4 and 8 rollout actors sharing one GPU, each a process of its own with its own envs,
as Ray actors on fractional GPU slices (actors.num_gpus) share a device: what a cluster config's slice is chosen from.

    python bench/actors_per_gpu.py --size full                                  # smolvla_base's shapes, on one GPU
    python bench/actors_per_gpu.py --size full --recipe configs/pi0_pick.yaml   # pi0 (pi05_pick.yaml: pi0.5); lerobot 0.6
    python bench/actors_per_gpu.py                                              # tiny SmolVLA on CPU: the mechanism only

Nothing downloads: the recipe's model is bench/smolvla_gpu.py's stand-in (random weights at the recipe's shapes),
written once and loaded by every actor. Each actor is actors.rollout_actor.RolloutActor in a fresh interpreter (as a
Ray actor is; no Ray here), with the recipe's envs per actor, precision and decision path (a CUDA graph on a GPU) and
its own actor index, hence its own seeds. It starts, runs --warmup rollouts (the first decision captures the graph or
compiles), reports ready, and waits; once every actor of that count is ready, all are released at once and each samples
--rollouts rollouts. A count's window runs from the first actor's release to the last actor's end.

Per count N (`actors_N/...`): decisions (envs x decisions per rollout x rollouts, over all actors), decisions_per_second
and env_steps_per_second over the window, decisions_per_second_per_actor, rollout_seconds (the median of every timed
rollout), the slowest start (construct_seconds, warmup_seconds), the device the actors ran on (actor_device: "cuda"
where the recipe's slice reached the GPU); on a GPU, each actor's own peak reserved memory (actor_peak_reserved_gib, the
largest) and the device memory the N actors take together once all are ready (actors_device_gib: in use then, every
actor's CUDA context included, less what was in use before they started). decisions_per_second_ratio_N_to_1 is N
actors' rate over one actor's: N where each actor keeps its pace alone, less as they wait on each other.
most_decisions_per_second_at: the count with the highest rate. On CPU the actors share the machine's cores instead
(one thread each, as RolloutActor sets), so the figures there show the mechanism, not a GPU's sharing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import REPO_ROOT, emit, load_average, ratio

GIB = 2.0**30
READY, GO = "ready", "go"  # the protocol's words: an actor's line once it has warmed up, the parent's release


def device_used_gib() -> float:
    """The GPU memory in use on this process's device, by every process on it (their CUDA contexts included)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def cuda_memory() -> dict[str, float]:
    """This process's peak reserved GPU memory and the device's memory in use by every process on it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"actor_peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB, "device_used_gib": device_used_gib()}


def send(message: dict[str, Any], stream) -> None:
    """One protocol line on the actor's real stdout (what the actor and the libraries print goes to stderr)."""
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def actor_process(config_file: Path, checkpoint: Path, actor_index: int, warmup: int, rollouts: int) -> None:
    """One actor: start, warm up, say ready, wait for the release, sample `rollouts` rollouts, report."""
    from actors.rollout_actor import RolloutActor
    from common.config import RunConfig
    from common.config_loading import from_dict

    protocol = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        config = from_dict(RunConfig, json.loads(config_file.read_text()))
        began = time.monotonic()
        actor = RolloutActor(config, actor_index, checkpoint)
        construct = time.monotonic() - began
        began = time.monotonic()
        for iteration in range(warmup):
            actor.sample(None, iteration=iteration)
        warmed = time.monotonic() - began
    send({READY: True, "construct_seconds": construct, "warmup_seconds": warmed, "device": actor.device.type}, protocol)
    if sys.stdin.readline().strip() != GO:
        raise SystemExit("actor: the parent closed without releasing the actors")
    memory = cuda_memory()  # every actor of this count is ready and holds its memory now
    start, timed, decisions, env_steps = time.monotonic(), [], 0, 0
    with contextlib.redirect_stdout(sys.stderr):
        for iteration in range(warmup, warmup + rollouts):
            began = time.monotonic()
            batch = actor.sample(None, iteration=iteration)
            timed.append(time.monotonic() - began)
            decisions += batch.num_decisions * batch.num_envs
            env_steps += batch.env_steps
    # time.monotonic is the system-wide CLOCK_MONOTONIC on Linux: the parent compares the actors' start and end times.
    send({"start": start, "end": time.monotonic(), "rollout_seconds": timed, "decisions": decisions, "env_steps": env_steps,
          **memory}, protocol)  # fmt: skip


def read_message(process: subprocess.Popen, index: int) -> dict[str, Any]:
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"actor {index} ended (exit {process.wait()}) before it reported; its output is above")
    return json.loads(line)


def run_count(args: argparse.Namespace, count: int, config_file: Path, checkpoint: Path, used_before: float) -> dict[str, Any]:
    """`count` actor processes on the device at once: start and warm them, release them together, gather their figures."""
    command = [sys.executable, str(Path(__file__).resolve()), "--config-file", str(config_file), "--checkpoint", str(checkpoint),
               "--warmup", str(args.warmup), "--rollouts", str(args.rollouts)]  # fmt: skip
    processes = [
        subprocess.Popen([*command, "--actor", str(index)], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for index in range(count)
    ]
    try:
        ready = [read_message(process, index) for index, process in enumerate(processes)]
        for process in processes:
            process.stdin.write(GO + "\n")
            process.stdin.flush()
        done = [read_message(process, index) for index, process in enumerate(processes)]
        for index, process in enumerate(processes):
            if process.wait() != 0:
                raise SystemExit(f"actor {index} exited with {process.returncode}; its output is above")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    seconds = max(d["end"] for d in done) - min(d["start"] for d in done)
    decisions, env_steps = sum(d["decisions"] for d in done), sum(d["env_steps"] for d in done)
    figures = {
        "decisions": decisions,
        "seconds": seconds,
        "decisions_per_second": decisions / seconds,
        "decisions_per_second_per_actor": decisions / seconds / count,
        "env_steps_per_second": env_steps / seconds,
        "rollout_seconds": statistics.median(s for d in done for s in d["rollout_seconds"]),
        "construct_seconds": max(r["construct_seconds"] for r in ready),
        "warmup_seconds": max(r["warmup_seconds"] for r in ready),
        "actor_device": ",".join(sorted({r["device"] for r in ready})),
    }
    if "device_used_gib" in done[0]:
        figures["actor_peak_reserved_gib"] = max(d["actor_peak_reserved_gib"] for d in done)
        figures["actors_device_gib"] = max(d["device_used_gib"] for d in done) - used_before
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.smolvla_gpu import write_inputs

    counts = args.counts
    cuda = torch.cuda.is_available()
    results: dict[str, Any] = {"size": args.size, "recipe": args.recipe.name, "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "cpu_count": os.cpu_count(), "load_average_1m_start": load_average()}  # fmt: skip
    used_before = 0.0
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, contextlib.redirect_stdout(sys.stderr):
        work = Path(tmp)
        config, checkpoint, _ = write_inputs(work, args.size, args.set, args.recipe)
        if not cuda:  # the recipe asks for a GPU slice; on CPU the actors run where they are
            config.actors.num_gpus = 0.0
        results["envs_per_actor"] = config.actors.envs_per_actor
        results["decisions_per_rollout"] = config.actors.decisions_per_rollout
        config_file = work / "run_config.json"
        config_file.write_text(json.dumps(config.to_dict(), default=str))
        if cuda:  # a pi0 stand-in is built on the GPU; what this process still holds is not the actors'
            torch.cuda.empty_cache()
            used_before = results["device_used_gib_before_actors"] = device_used_gib()
        for count in counts:
            print(f"[actors_per_gpu] {count} actor(s) at once", file=sys.stderr, flush=True)
            results[f"actors_{count}"] = run_count(args, count, config_file, checkpoint, used_before)
    one = results["actors_1"]["decisions_per_second"]
    for count in counts[1:]:
        results[f"decisions_per_second_ratio_{count}_to_1"] = ratio(results[f"actors_{count}"]["decisions_per_second"], one)
    results["most_decisions_per_second_at"] = max(counts, key=lambda n: results[f"actors_{n}"]["decisions_per_second"])
    results["load_average_1m_end"] = load_average()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO_ROOT / "configs" / "smolvla_pick.yaml")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--actors", default="1,2,4,8", help="comma-separated actor counts, 1 among them")
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per actor")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rollouts per actor before the release (graph capture, compile)")
    parser.add_argument("--work-dir", default=None, help="where the stand-in and checkpoint are written (a temporary dir)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="run-config override (as learner.main)")
    parser.add_argument("--actor", type=int, default=None, help=argparse.SUPPRESS)  # one actor, in this process
    parser.add_argument("--config-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rollouts < 1 or args.warmup < 0:
        parser.error("--rollouts must be at least 1 and --warmup at least 0")
    try:
        args.counts = sorted({int(n) for n in args.actors.split(",")})
    except ValueError:
        parser.error(f"--actors {args.actors}: comma-separated whole numbers")
    if args.counts[0] != 1:
        parser.error(f"--actors {args.actors}: the counts must be positive and include 1 (each is set against one actor)")
    if args.actor is not None:
        actor_process(args.config_file, args.checkpoint, args.actor, args.warmup, args.rollouts)
        return 0
    emit(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
