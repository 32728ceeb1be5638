"""LearnerActor: the Ray actor around learner.update.learner.Learner (gathers rollouts, updates, publishes weights,
checkpoints, exports gauges).

It has its own module because Ray starts the learner's worker by importing the module that defines its class: here
that is torch, Ray and the learner, not the driver's Metaworld, envs and rollout actors (CPU seconds that the learner's
process would spend at every start, on cores the rollout actors are starting on). It is handed the run's tasks, so its
updates import no simulator either.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import ray
import torch

from actors.run_files import RunFiles
from common.config import RunConfig
from common.file_digests import trust_digests
from common.metrics import rollout_metrics
from common.policy import FlowPolicy, build_policy
from common.trajectory import RolloutBatch
from learner.group.ranks import join_learner_group
from learner.runtime.monitoring import GaugeExporter, per_actor_metrics
from learner.update.learner import Learner


class LearnerActor:
    """Ray actor around Learner: gathers rollouts, updates, publishes weights, checkpoints, exports gauges."""

    def __init__(
        self,
        config: RunConfig,
        checkpoint_dir: str | None,
        resume_dir: str | None,
        niceness: int | None = None,
        state_bounds: list[list[float]] | None = None,
        known_digests: dict | None = None,
        group: tuple[str, int, int] | None = None,
        files: RunFiles | None = None,
        tasks: list[str] | None = None,
    ):
        """niceness: the driver's, which the learner takes when its process runs at a higher one. A local Ray starts its
        workers at 0 (start_local_ray), a node's Ray started without RAY_worker_niceness=0 at 15, from which only a
        privileged process comes back: there the learner stays at 15, still above the actors' (learner.runtime.startup.ACTOR_NICENESS).
        state_bounds: (low, high) of the suite's state, for a random init to normalise to (learner.runtime.startup.start_learner).
        known_digests: the driver's file digests, as for actors.rollout_actor.RolloutActor.
        group: (rendezvous address, rank, ranks) of a learner group (learner.runtime.learner_group); None: the learner alone.
        files: where the run's files are (actors.run_files): a learner on another node reads its starting checkpoint
        from there and writes its checkpoints there; None: here.
        tasks: the run's tasks, resolved by the driver's suite, so that this process imports no simulator (Learner)."""
        trust_digests(known_digests)
        if niceness is not None and os.getpriority(os.PRIO_PROCESS, 0) > niceness:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
            except PermissionError:
                pass
        torch.manual_seed(config.seed)
        self.files = files or RunFiles()
        start = resume_dir or checkpoint_dir
        with self.files.local_copy(start) if start else contextlib.nullcontext() as directory:
            if directory:
                policy = FlowPolicy.from_pretrained(directory, **config.policy.sampling_overrides())
            else:
                policy = build_policy(config.policy)  # Learner refuses it unless allow_random_init
                if state_bounds is not None:  # the suite's (low, high): no demonstration has set the state's statistics
                    policy.set_state_bounds(*(torch.tensor(bound, dtype=torch.float32) for bound in state_bounds))
            # A GPU (learner.num_gpus > 0) makes Ray set CUDA_VISIBLE_DEVICES for this actor; the learner stays float32.
            policy.to("cuda" if config.learner.num_gpus > 0 and torch.cuda.is_available() else "cpu")
            ranks = None if group is None else join_learner_group(*group, policy.obs_device)
            self.learner = Learner(config, policy, ranks=ranks, tasks=tasks)
            if resume_dir is not None:
                self.learner.load_trainer_state(directory)
        self.gauges = GaugeExporter(config.env.task)

    def progress(self) -> tuple[int, int]:
        """(completed iterations, env steps sampled for them), both restored from the checkpoint on resume."""
        return self.learner.iteration, self.learner.env_steps

    def add_demonstrations(self, tasks: dict[str, int]) -> list[str]:
        """Stalled tasks' demonstrations into the updates from the iteration given with each (Learner.add_demonstrations)."""
        return self.learner.add_demonstrations(tasks)

    def update(self, *batches: RolloutBatch, verbose: bool = False) -> dict[str, float]:
        """This learner's update on `batches` (in a group: this rank's share of the iteration's rollouts), and the
        iteration's metrics; in a group, rank 0 reports them for every rank, and the other ranks report nothing."""
        ranks = self.learner.ranks
        with ranks.together("learner.update"):  # a share refused here is refused on every rank
            batch = RolloutBatch.concat(list(batches))  # Learner.update validates it
        version_before = self.learner.version
        start, start_cpu = time.perf_counter(), time.process_time()
        metrics = self.learner.update(batch, verbose=verbose)
        shares = ranks.gather_to_first([share.statistics_only() for share in batches] if ranks.size > 1 else batches)
        if shares is None:
            return {}
        batches = [share for rank_shares in shares for share in rank_shares]
        batch = batch if ranks.size == 1 else RolloutBatch.concat(batches)
        metrics.update(rollout_metrics(batch, version_before))
        metrics.update(per_actor_metrics(batches, version_before))
        metrics["rollout/state_beyond_clip"] = self.learner.policy.share_beyond_clip(torch.from_numpy(batch.obs.state))
        metrics["time/update_seconds"] = time.perf_counter() - start
        metrics["time/update_cpu_seconds"] = time.process_time() - start_cpu
        # The env stepping's share of the CPU work of an iteration (actors' policy and envs, the learner's update):
        # where everything shares the cores, whole-iteration env steps/s can reach at most this fraction of the
        # bare envs' rate (bench/throughput.py's ratio to the env limit).
        work = batch.env_cpu_seconds + batch.policy_cpu_seconds + metrics["time/update_cpu_seconds"]
        metrics["time/env_cpu_share"] = batch.env_cpu_seconds / work if work > 0 else math.nan
        return metrics

    def publish(self) -> list[ray.ObjectRef]:
        """ONE ray.put per weight version; wrapped in a list so Ray hands the driver the reference itself. The payload
        views the weights (no copy): ray.put has serialised it into the object store when it returns. In a group only
        rank 0 puts; the others keep the version for the rollouts in flight."""
        if self.learner.ranks.rank > 0:
            self.learner.record_version()
            return []
        return [ray.put(self.learner.broadcast(copy=False))]

    def publish_in_flight(self) -> list[ray.ObjectRef]:
        """The weights that sample iterations k, ..., k + policy_lag (k: completed iterations; Learner.in_flight_versions),
        one ray.put per distinct version; the last is the current version. Called when a learner (re)starts."""
        if self.learner.ranks.rank > 0:
            return self.publish()
        refs = {self.learner.version: self.publish()[0]}
        versions = self.learner.in_flight_versions()
        for version in versions:
            if version not in refs:
                refs[version] = ray.put(self.learner.weight_versions.payload(version))
        return [refs[version] for version in versions]

    def save(self, directory: str) -> str:
        """The learner's checkpoint (Learner.save_checkpoint) at `directory` on the node of the run's files; in a group
        every rank is called (a sharded one gathers its shards) and rank 0 writes it."""
        if self.learner.ranks.rank > 0:
            return str(self.learner.save_checkpoint(directory))
        return str(self.files.write(directory, self.learner.save_checkpoint))

    def files_elsewhere(self) -> bool:
        """Whether the run's files are on another node than this learner's (they travel through the object store)."""
        return not self.files.here()

    def export_gauges(self, metrics: dict[str, float]) -> None:
        """Publish every numeric metric as a tagged ray.util.metrics Gauge (Ray dashboard / Prometheus)."""
        self.gauges.export(metrics)
