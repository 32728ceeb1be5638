"""The learner's update with 1 rank against N ranks of a learner group, on the same iteration's rollouts, in one run;
and the cost of the gradient all-reduce that each of the group's optimiser steps adds.

    nice -n 5 python bench/learner_scaling.py                   # 4 actors x 2 envs x 50 decisions, ranks 1 and 2
    python bench/learner_scaling.py --actors 10                 # the main job's batch (10 x 2 x 50 decisions)
    python bench/learner_scaling.py --ranks 1,2,4               # where the machine has 4 cores for 4 ranks
    python bench/learner_scaling.py --sharding fsdp             # the groups' ranks each hold a shard (learner.sharding)
    python bench/learner_scaling.py --ranks 1,2 --repeats 1 --warmup 0 --actors 2 --envs-per-actor 1 --decisions 4  # a smoke run

- rollouts: one iteration's, sampled once in this process by --actors rollout actors (actors.rollout_actor.RolloutActor,
  plain objects, no Ray) from the behaviour-cloned checkpoint (--checkpoint, else the config's cached BC checkpoint,
  built on first use: learner.runtime.startup.resolve_init_checkpoint), so version-0 rollouts of the learner's own weights.
  The update's batch is --actors x --envs-per-actor x --decisions decisions (decisions_per_update), whatever the
  ranks. The config is the embedded default (or --config) with those sizes, algorithm.critic_warmup_iters=0 (the
  update trains the actor, as every iteration after the critic's warm-up does) and --set over them.
- ranks: N=1 is the learner alone, a plain LearnerActor started with ray.remote (learner.group.ranks.SingleRank,
  no process group), so that it is reached through Ray as the group's ranks are; N>1 is a learner group of N
  LearnerActors (learner.runtime.learner_group.start_learner_group: a placement group, torch.distributed gloo). Every rank
  asks for --cpus-per-rank CPUs (torch then runs that many threads in it: torch_threads_per_rank), so N ranks use N
  times the cores of one; a rank gets a consecutive share of the actors' rollouts, as the driver hands them out
  (learner.runtime.learner_handle). Each N has its own fresh actors for the whole run, all started at once and idle
  while another N runs; the local Ray is sized for all of them together (the sum of --ranks x --cpus-per-rank).
- update: each N's update on the same rollouts (in the object store once; each rank fetches its share), --warmup
  times untimed and then --repeats times, the repeats of the Ns taking turns; before every update each rank's
  learner is rebuilt from the checkpoint (weights, optimiser, iteration counter: the same update every time).
  update_seconds_N: the median of rank 0's time/update_seconds (the update and the gathering of the metrics, measured
  inside the rank); update_wall_seconds_N: the median wall time of the ray.get over every rank's update call (with the
  fetching of the rollouts and Ray's calls). update_seconds_ratio_N_to_1 and update_wall_seconds_ratio_N_to_1: N
  ranks' over the learner alone's (below 1: the ranks make the update faster).
- memory: rank_{parameter,gradient,optimizer}_bytes_N, what the rank that holds the most holds after the last update
  (Learner.state_bytes: the learner alone's own, a group's memory/rank_* metrics), and rank_state_bytes_ratio_N_to_1,
  the three together against the learner alone's: 1 for an unsharded group, about 1/N with --sharding fsdp.
- all-reduce (unsharded groups; a sharded one reduces and scatters its gradients in the backward passes): in each
  group, torch.distributed.all_reduce of one flat float32 tensor of trainable_parameters elements
  (what RankGroup.sum_gradients reduces at each optimiser step) on the policy's device, on every rank at once, after
  a barrier, --all-reduce-calls times after 2 untimed ones: all_reduce_seconds_N is the median over the calls of the
  slowest rank's time. all_reduce_share_of_update_N = optimizer_steps_per_update x all_reduce_seconds_N /
  update_seconds_N, the part of the update that the gradients' all-reduces take (the other collectives move a few
  numbers each).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from actors.rollout_actor import RolloutActor
from bench.report import emit, load_average, ratio
from common.config import RunConfig
from common.config_loading import load_config
from common.policy import FlowPolicy
from common.trajectory import RolloutBatch
from learner.runtime.learner_actor import LearnerActor
from learner.runtime.learner_group import LearnerRanks, start_learner_group
from learner.runtime.ray_runtime import ResourceRequest, start_local_ray
from learner.runtime.startup import check_checkpoint_matches, resolve_init_checkpoint
from learner.update.learner import Learner

# Untimed all-reduces before the timed ones (the first ones set up gloo's buffers).
ALL_REDUCE_WARMUP_CALLS = 2


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def sample_rollouts(config: RunConfig, checkpoint: Path) -> list[RolloutBatch]:
    """One iteration's rollouts of the checkpoint's weights (version 0), one batch per actor."""
    return [RolloutActor(config, index, checkpoint).sample(None, iteration=0) for index in range(config.actors.num_actors)]


def rank_facts(actor: LearnerActor) -> tuple[int, int]:
    """(trainable parameters, what RankGroup.sum_gradients reduces; torch's threads) of one rank."""
    learner = actor.learner
    return sum(p.numel() for p in learner.actor_params + learner.critic_params), torch.get_num_threads()


def rebuild_learner(actor: LearnerActor, config: RunConfig, checkpoint: str) -> None:
    """The rank's learner as LearnerActor built it (the checkpoint's weights, a fresh optimiser, iteration 0), in the
    same process group; a collective (Learner broadcasts rank 0's weights), so called on every rank at once."""
    torch.manual_seed(config.seed)
    policy = FlowPolicy.from_pretrained(checkpoint, **config.policy.sampling_overrides())
    policy.to(actor.learner.policy.obs_device)
    actor.learner = Learner(config, policy, ranks=actor.learner.ranks)


def time_all_reduce(actor: LearnerActor, calls: int) -> list[float]:
    """Seconds of each of `calls` all-reduces of a flat float32 tensor the size of the rank's trainable parameters."""
    learner = actor.learner
    device = learner.policy.obs_device
    flat = torch.ones(sum(p.numel() for p in learner.actor_params + learner.critic_params), dtype=torch.float32, device=device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = []
    for call in range(ALL_REDUCE_WARMUP_CALLS + calls):
        dist.barrier()
        synchronize()
        began = time.perf_counter()
        dist.all_reduce(flat)
        synchronize()
        if call >= ALL_REDUCE_WARMUP_CALLS:
            seconds.append(time.perf_counter() - began)
    return seconds


def bench_config(args: argparse.Namespace, size: int) -> RunConfig:
    """The recipe with the bench's sizes, the actor trained from the first update, --set, then `size` learner ranks."""
    sizes = [f"actors.num_actors={args.actors}", f"actors.envs_per_actor={args.envs_per_actor}",
             f"actors.decisions_per_rollout={args.decisions}", "algorithm.critic_warmup_iters=0"]  # fmt: skip
    sharding = args.sharding if size > 1 else "none"  # the learner alone holds the whole policy
    return load_config(args.config, [*sizes, *args.set, f"learner.num_learners={size}", f"learner.sharding={sharding}"])


def start_ranks(config: RunConfig, size: int, cpus_per_rank: float, checkpoint: Path) -> LearnerRanks:
    """N=1: a plain LearnerActor (the learner alone); N>1: a learner group of N ranks. `config` has N learners."""
    request = ResourceRequest(cpus_per_rank, config.learner.num_gpus, dict(config.learner.resources))
    if size == 1:
        return LearnerRanks([ray.remote(LearnerActor).options(**request.options()).remote(config, str(checkpoint), None)])
    return start_learner_group(config, request, LearnerActor, config, str(checkpoint), None)


def timed_update(ranks: LearnerRanks, config: RunConfig, checkpoint: Path, refs: list[ray.ObjectRef]) -> tuple[dict[str, float], float]:
    """Every rank's learner rebuilt, then one update on its consecutive share of `refs`: rank 0's metrics and the wall
    seconds of the ray.get over every rank's update call."""
    ray.get([actor.__ray_call__.remote(rebuild_learner, config, str(checkpoint)) for actor in ranks.actors])
    shares = np.array_split(np.arange(len(refs)), len(ranks.actors))
    began = time.perf_counter()
    answers = ray.get([actor.update.remote(*(refs[i] for i in share)) for actor, share in zip(ranks.actors, shares)])
    return answers[0], time.perf_counter() - began


def parse_ranks(text: str, cpus_per_rank: float) -> list[int]:
    try:
        sizes = sorted({int(n) for n in text.split(",")})
    except ValueError:
        raise SystemExit(f"--ranks must be comma-separated integers like 1,2, got {text!r}") from None
    if sizes[0] != 1 or len(sizes) < 2:
        raise SystemExit(f"--ranks must hold 1 (the learner alone, the ratios' base) and at least one group size, got {text!r}")
    cores = os.cpu_count() or 1
    if sizes[-1] * cpus_per_rank > cores:
        raise SystemExit(f"{sizes[-1]} ranks x {cpus_per_rank:g} CPUs (--cpus-per-rank) exceed this machine's {cores} cores")
    return sizes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts N, 1 among them")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per N (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per N before the timed ones")
    parser.add_argument("--actors", type=int, default=4, help="rollout actors (actors.num_actors); at least the largest N")
    parser.add_argument("--envs-per-actor", type=int, default=2, help="actors.envs_per_actor")
    parser.add_argument("--decisions", type=int, default=50, help="decisions per rollout (actors.decisions_per_rollout)")
    parser.add_argument("--cpus-per-rank", type=float, default=1.0, help="CPUs each rank asks Ray for")
    parser.add_argument("--all-reduce-calls", type=int, default=20, help="timed all-reduces per group (the median is reported)")
    parser.add_argument("--checkpoint", default=None, help="policy directory (default: the config's cached BC checkpoint)")
    parser.add_argument("--config", default=None, help="a recipe (default: the embedded default)")
    parser.add_argument("--sharding", choices=("none", "fsdp"), default="none", help="learner.sharding of the groups (N > 1)")
    parser.add_argument("--set", action="append", default=[], help="a dotted override, as learner.main takes (after the sizes)")
    args = parser.parse_args(argv)
    sizes = parse_ranks(args.ranks, args.cpus_per_rank)
    if min(args.repeats, args.all_reduce_calls) < 1 or args.warmup < 0:
        raise SystemExit("--repeats and --all-reduce-calls must be >= 1, --warmup >= 0")
    if args.actors < sizes[-1]:
        raise SystemExit(f"--actors ({args.actors}) must be at least the largest rank count ({sizes[-1]}): one per rank at least")
    configs = {size: bench_config(args, size) for size in sizes}
    config = configs[1]
    with contextlib.redirect_stdout(sys.stderr):  # a BC checkpoint built on first use reports its progress
        checkpoint = Path(args.checkpoint) if args.checkpoint else resolve_init_checkpoint(config)
    if checkpoint is None:
        raise SystemExit("the bench updates a behaviour-cloned policy: pass --checkpoint, or leave allow_random_init off")
    check_checkpoint_matches(config, checkpoint)

    results: dict[str, Any] = {"bench": "learner_scaling", "cpu": cpu_model(), "cpu_count": os.cpu_count(), "ray": ray.__version__,
                               "torch": torch.__version__, "load_average_1m_start": load_average()}  # fmt: skip
    began = time.perf_counter()
    batches = sample_rollouts(config, checkpoint)
    results["sample_seconds"] = time.perf_counter() - began
    results.update(actors=args.actors, envs_per_actor=args.envs_per_actor, decisions_per_rollout=args.decisions,
                   decisions_per_update=sum(batch.num_decisions * batch.num_envs for batch in batches), ranks=args.ranks,
                   cpus_per_rank=args.cpus_per_rank, repeats=args.repeats, sharding=args.sharding)  # fmt: skip

    start_local_ray(num_cpus=sum(sizes) * args.cpus_per_rank, include_dashboard=False, log_to_driver=False)
    groups: dict[int, LearnerRanks] = {}
    try:
        refs = [ray.put(batch) for batch in batches]
        for size in sizes:
            groups[size] = start_ranks(configs[size], size, args.cpus_per_rank, checkpoint)
        facts = {size: ray.get([actor.__ray_call__.remote(rank_facts) for actor in ranks.actors]) for size, ranks in groups.items()}
        results["trainable_parameters"] = facts[1][0][0]
        results["torch_threads_per_rank"] = min(threads for size in sizes for _, threads in facts[size])

        for size in sizes:
            for _ in range(args.warmup):
                timed_update(groups[size], configs[size], checkpoint, refs)
        metrics: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
        walls: dict[int, list[float]] = {size: [] for size in sizes}
        for repeat in range(args.repeats):  # the Ns take turns, each repeat starting with the next one
            for size in sizes[repeat % len(sizes) :] + sizes[: repeat % len(sizes)]:
                answer, wall = timed_update(groups[size], configs[size], checkpoint, refs)
                metrics[size].append(answer)
                walls[size].append(wall)
        alone_bytes = ray.get(groups[1].actors[0].__ray_call__.remote(lambda actor: actor.learner.state_bytes()))
        for size in sizes[1 if args.sharding == "none" else len(sizes) :]:
            calls = ray.get([actor.__ray_call__.remote(time_all_reduce, args.all_reduce_calls) for actor in groups[size].actors])
            results[f"all_reduce_seconds_{size}"] = statistics.median(max(call) for call in zip(*calls))
    finally:
        for ranks in groups.values():
            ranks.kill()
        ray.shutdown()

    steps = {size: int(metrics[size][0]["ppo/optimizer_steps"]) for size in sizes}
    results["optimizer_steps_per_update"] = steps[1]
    for size in sizes:
        results[f"update_seconds_{size}"] = statistics.median(m["time/update_seconds"] for m in metrics[size])
        results[f"update_wall_seconds_{size}"] = statistics.median(walls[size])
        if steps[size] != steps[1]:  # KL early stopping can end an update a step apart
            results[f"optimizer_steps_per_update_{size}"] = steps[size]
        held = alone_bytes if size == 1 else {name: int(metrics[size][-1][f"memory/rank_{name}"]) for name in alone_bytes}
        results.update({f"rank_{name}_{size}": value for name, value in held.items()})
    for size in sizes[1:]:
        results[f"update_seconds_ratio_{size}_to_1"] = ratio(results[f"update_seconds_{size}"], results["update_seconds_1"])
        results[f"update_wall_seconds_ratio_{size}_to_1"] = ratio(results[f"update_wall_seconds_{size}"], results["update_wall_seconds_1"])
        state = [sum(results[f"rank_{name}_{n}"] for name in alone_bytes) for n in (size, 1)]
        results[f"rank_state_bytes_ratio_{size}_to_1"] = ratio(*state)
        if args.sharding == "none":
            all_reduces = steps[size] * results[f"all_reduce_seconds_{size}"]
            results[f"all_reduce_share_of_update_{size}"] = ratio(all_reduces, results[f"update_seconds_{size}"])
    results["load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
