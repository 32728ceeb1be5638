"""Ray's share of an iteration: the main job on Ray against the same rollouts and update in one process, in one run.

    nice -n 5 python bench/overhead.py                  # 6 iterations of the default job (10 actors), 2 left out
    python bench/overhead.py --iterations 2 --warmup-iterations 1 --main-arg=--num-actors=2 ...   # a smoke run
    python bench/overhead.py --in-process-only --iterations 5 --warmup-iterations 0   # the job's bits, for two checkouts

- on Ray: `python -m learner.main --checkpoint <the config's BC checkpoint>` (bench/throughput.py's main_job,
  eval_every=0, lag 0). Per iteration, metrics.jsonl holds the wall time, the slowest actor's sampling time measured
  inside that actor and the learner's update time measured inside the learner. ray_share = 1 - (sampling +
  update) / iteration, over the timed iterations: what the iteration spends outside the work (scheduling, object
  transfers, weight publication, the driver's waits). The goal: under 0.05.
- in one process: the same config's rollout actors (actors.rollout_actor.RolloutActor) and learner
  (learner.update.learner.Learner) as plain objects, each actor sampling in turn with the published weights, then the
  update and the broadcast: no Ray, no parallelism. Rollouts are a pure function of (weights, seed, iteration,
  actor), so these are the same rollouts and updates as on Ray: same_final_weights is 1 when the in-process
  learner ends with the Ray run's checkpoint, bit for bit.
- in_process_over_ray: in-process iteration seconds / Ray's, what the actors' parallelism buys on this machine.
- in_process_fingerprint: SHA-256 of the in-process loop's every rollout array, every update's metrics and the final
  weights. Run in two checkouts, equal fingerprints mean a change left every bit of the job as it was: how the
  speed-ups are checked to leave learning unchanged (`--in-process-only` skips the Ray run for that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from actors.rollout_actor import RolloutActor
from bench.report import emit, load_average, ratio, record_arrays
from bench.throughput import main_job
from common.policy import WEIGHTS_FILE, FlowPolicy, build_policy
from common.trajectory import RolloutBatch
from learner.main import parse_args, resolve_config
from learner.runtime.startup import resolve_init_checkpoint
from learner.update.learner import Learner


def in_process(
    config, checkpoint: Path | None, iterations: int, warmup: int, scratch: Path
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The Ray run's loop with plain objects in this process; its figures and the learner's final weights."""
    torch.manual_seed(config.seed)  # as LearnerActor does, so a random init (no checkpoint) is the Ray run's too
    policy = FlowPolicy.from_pretrained(checkpoint, **config.policy.sampling_overrides()) if checkpoint else build_policy(config.policy)
    learner = Learner(config, policy)
    actor_checkpoint = checkpoint or learner.save_checkpoint(scratch / "random_init")
    actors = [RolloutActor(config, index, str(actor_checkpoint)) for index in range(config.actors.num_actors)]
    weights = learner.broadcast()
    seconds: dict[str, list[float]] = {"iteration": [], "sample": [], "update": []}
    fingerprint = hashlib.sha256()
    for iteration in range(iterations):
        began = time.perf_counter()
        batches = [actor.sample(weights, iteration) for actor in actors]
        sampled = time.perf_counter()
        metrics = learner.update(RolloutBatch.concat(batches))
        updated = time.perf_counter()
        for batch in batches:
            for name, array in record_arrays(batch).items():  # the record; its scalars are timings and counts
                fingerprint.update(name.encode() + array.tobytes())
        fingerprint.update(json.dumps(metrics, sort_keys=True).encode())
        weights = learner.broadcast()
        if iteration >= warmup:
            seconds["iteration"].append(time.perf_counter() - began)
            seconds["sample"].append(sampled - began)
            seconds["update"].append(updated - sampled)
    figures: dict[str, float | str] = {f"in_process_median_{name}_seconds": statistics.median(values) for name, values in seconds.items()}
    final = {name: tensor.detach().clone() for name, tensor in learner.policy.state_dict().items()}
    for name, tensor in sorted(final.items()):
        fingerprint.update(name.encode() + tensor.numpy().tobytes())
    figures["in_process_fingerprint"] = fingerprint.hexdigest()
    return figures, final


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6, help="iterations of each loop")
    parser.add_argument("--warmup-iterations", type=int, default=2, help="first iterations left out of the figures")
    parser.add_argument("--main-arg", action="append", default=[], help="extra learner.main argument, --flag=value (repeatable)")
    parser.add_argument("--in-process-only", action="store_true", help="only the in-process loop: its figures and fingerprint")
    args = parser.parse_args(argv)
    if args.iterations <= args.warmup_iterations or args.warmup_iterations < 0:
        raise SystemExit(f"--iterations ({args.iterations}) must exceed --warmup-iterations ({args.warmup_iterations}) >= 0")
    # The config learner.main resolves from the same arguments (main_job adds the same iterations and eval_every).
    main_argv = [*args.main_arg, "--set=actors.policy_lag=0"]
    config = resolve_config(parse_args([*main_argv, "--iterations", str(args.iterations), "--set", "eval_every=0"]))
    checkpoint = resolve_init_checkpoint(config)
    results: dict = {"bench": "overhead", "actors": config.actors.num_actors, "load_average_1m_start": load_average()}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as scratch:
        figures, weights = in_process(config, checkpoint, args.iterations, args.warmup_iterations, Path(scratch))
        results.update(figures)
        if not args.in_process_only:
            run_dir = Path(scratch) / "run"
            main_args = [*main_argv, *([f"--checkpoint={checkpoint}"] if checkpoint else [])]
            on_ray = main_job(args.iterations, args.warmup_iterations, 2, main_args, run_dir=run_dir)
            ray_weights = load_file(str(run_dir / "checkpoints" / f"iter_{args.iterations:06d}" / WEIGHTS_FILE))
            results.update({key.replace("main_", "ray_", 1): value for key, value in on_ray.items()})
            results["ray_share"] = results.pop("ray_outside_work_share")
            results["in_process_over_ray"] = ratio(results["in_process_median_iteration_seconds"], results["ray_median_iteration_seconds"])
            results["same_final_weights"] = int(
                weights.keys() == ray_weights.keys() and all(torch.equal(weights[k], ray_weights[k]) for k in weights)
            )
    results["load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
