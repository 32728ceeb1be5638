"""What compiling costs a rollout actor that starts, with the machine's compile cache empty and with it holding what an
earlier actor compiled: actors.speed.compile_steps and compile_vision on a VLA, each start a fresh process, as a
started or restarted Ray actor is.

    python bench/compile_cache.py                               # tiny SmolVLA on CPU (the tests' size)
    python bench/compile_cache.py --size full                   # smolvla_base's shapes; on a GPU
    python bench/compile_cache.py --recipe configs/pi0_pick.yaml  # pi0 (lerobot 0.6)
    python bench/compile_cache.py --set actors.speed.compile_vision=false   # the denoising steps alone

torch.compile keeps what it builds in its cache directory (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_$USER:
one per machine and user, which every actor and learner of a node reads): the kernels it generated and, keyed by the
traced graph, the compiled graph itself (the FX graph cache) and its autograd wrapping. A later process that traces the
same graph on the same machine loads those and skips the compiler's work; tracing still runs in every process.

Each start, in a process of its own, builds the inputs (bench/smolvla_gpu.py's stand-in at --size), then times the
RolloutActor's construction and its first rollout, the one whose first decision compiles, and a second rollout, which
runs the compiled graphs: `<start>_compile_seconds` is first minus second. Starts: `cold`, over an empty cache directory,
then `warm`, a new process over the directory `cold` filled. With each, the cache's hits and misses as torch counts them
(`fxgraph_cache_hit`, `fxgraph_cache_miss`: a miss is a graph compiled again). warm_over_cold_compile: the share of the
compile a warm start still pays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import REPO_ROOT, emit, load_average, ratio

COMPILES = ("actors.speed.compile_steps=true", "actors.speed.compile_vision=true")
CACHE_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss")


def start(recipe: Path, size: str, sets: list[str]) -> dict[str, Any]:
    """One actor's start in this process: construction, the first rollout (which compiles) and a second one."""
    import torch
    from torch._dynamo.utils import counters

    from actors.rollout_actor import RolloutActor
    from bench.smolvla_gpu import write_inputs

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config, checkpoint, _ = write_inputs(Path(tmp), size, [*COMPILES, *sets], recipe)
        if not torch.cuda.is_available():
            config.actors.num_gpus = 0.0
        began = time.perf_counter()
        actor = RolloutActor(config, 0, checkpoint)
        figures["construct_seconds"] = time.perf_counter() - began
        for name, iteration in (("first_rollout_seconds", 0), ("second_rollout_seconds", 1)):
            began = time.perf_counter()
            actor.sample(None, iteration=iteration)
            figures[name] = time.perf_counter() - began
    figures["compile_seconds"] = figures["first_rollout_seconds"] - figures["second_rollout_seconds"]
    figures.update({name: counters["inductor"][name] for name in CACHE_COUNTERS})
    return figures


def start_in_a_process(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    """`start` in a fresh interpreter whose compile cache is `cache`; its figures, read from its last output line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--start", "--recipe", str(args.recipe), "--size", args.size]
    command += [f"--set={item}" for item in args.set]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    began = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a start failed (exit {done.returncode}); its output is above")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO_ROOT / "configs" / "smolvla_pick.yaml")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="run-config override (as learner.main)")
    parser.add_argument("--start", action="store_true", help=argparse.SUPPRESS)  # one start, in this process
    args = parser.parse_args(argv)
    if args.start:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the figures only
            figures = start(args.recipe, args.size, args.set)
        print(json.dumps(figures), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"
        results: dict[str, Any] = {"size": args.size, "recipe": args.recipe.name, "load_average_1m_start": load_average()}
        for name in ("cold", "warm"):
            print(f"[compile_cache] {name} start over {cache}", file=sys.stderr, flush=True)
            results[name] = start_in_a_process(args, cache)
    results["warm_over_cold_compile"] = ratio(results["warm"]["compile_seconds"], results["cold"]["compile_seconds"])
    results["warm_over_cold_first_rollout"] = ratio(results["warm"]["first_rollout_seconds"], results["cold"]["first_rollout_seconds"])
    results["load_average_1m_end"] = load_average()
    emit(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
