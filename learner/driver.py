"""The training loop behind `python -m learner.main`, and what keeps it going when parts of it fail.

Orchestration only: start or join Ray, bring up the learner and the rollout actors, then loop (sample ->
update -> broadcast -> evaluate/checkpoint/log). With actors.policy_lag = L > 0 the sampling of the next L
iterations is submitted before each update, so the actors sample with the versions before it while the
learner trains (learner.learner explains how the update accounts for the lag). The math lives in common/, the optimisation in
learner/learner.py, the sampling in actors/. Weights flow one way as versioned state (one `ray.put` per
version by the learner, every actor reads the same reference); rollouts flow the other way as typed numpy
records, straight from the actors into the learner (their object refs are passed to the learner's update,
not through the driver).

Faults, and what each costs:
- A rollout actor that dies, or wedges (no answer within actors.call_timeout_s; it is killed), is restarted
  by Ray (actors.max_restarts) and its call retried with the same arguments. A rollout is a pure function of
  (weights, run seed, iteration, actor index), so the retry yields exactly the samples the dead attempt would
  have: its partial work never reaches the learner, nothing is lost or counted twice. With its restarts spent
  the actor is dropped with a warning and the rest go on; below actors.min_alive the run stops.
- A learner actor that dies is started again from the run's latest checkpoint (learner.max_restarts times).
  The iterations since that checkpoint are redone, identically, and weight versions continue from it.
  Rollouts in flight (policy_lag > 0) are dropped and sampled again with the versions that sampled them first,
  which the checkpoint keeps (as on --resume), so the redone iterations are the same at any lag.
- A NaN/Inf update is rolled back and skipped inside the learner (learner.learner.Learner.update).
- Any other error, Ctrl-C or SIGTERM first saves the learner's progress as a checkpoint, if it is alive.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import yaml
from ray._private import state
from ray.exceptions import ActorDiedError, OwnerDiedError, RayActorError

from actors.rollout_actor import RolloutActor
from common.config import ConfigError, RunConfig
from common.diagnostics import check_ratio_sensitivity
from common.envs import adopt_benchmark_tasks, benchmark_task_tables, held_benchmark_tasks, layouts
from common.flow import num_log_prob_elements
from common.metrics import MetricsLog, console_line, eval_metrics, plot_learning_curve
from common.policy import WEIGHTS_FILE, build_policy, file_sha256, read_policy_config
from learner.cluster import (
    FIRST_ACTOR_BUNDLE,
    LEARNER_BUNDLE,
    ResourceRequest,
    actor_request,
    learner_request,
    node_cluster_address,
)
from learner.learner import update_shape
from learner.learner_actor import LearnerActor
from learner.manifest import reproducibility_manifest
from learner.monitoring import actor_health
from learner.pretrain import REPORT_FILE, ensure_bc_checkpoint
from learner.run_dir import RunDirectory

MIN_CPUS_PER_ACTOR = 0.05  # below this, actors time-share a core so thinly that the run crawls: a config mistake
# The rollout actors' scheduling niceness. At policy_lag 1 the learner's update (one thread) runs while the actors
# sample, and it is the iteration's critical path: at equal niceness, ten actors and the learner on two cores left
# the update 3.6 s of wall time for 1.5 s of CPU, and one core idle once the actors were done. With the actors at a
# lower priority the learner gets a core whenever it works, and the actors every cycle it leaves (bench/throughput.py,
# default job: iterations 3.6 -> 3.3 s). The same arithmetic either way: only the order of who runs changes.
ACTOR_NICENESS = 19


# ---------------------------------------------------------------------------------------------- faults


class LearnerDiedError(RuntimeError):
    """The learner actor's process is gone."""


class ActorsExhaustedError(RuntimeError):
    """Fewer rollout actors are left than actors.min_alive."""


def learner_get(ref: ray.ObjectRef) -> Any:
    """ray.get on a learner call; the learner's death becomes LearnerDiedError (the driver restarts it)."""
    try:
        return ray.get(ref)
    except RayActorError as exc:
        raise LearnerDiedError(str(exc).splitlines()[0]) from exc


@dataclass
class PendingCall:
    """One method call on every actor of a pool, submitted and not yet collected (ActorPool.collect)."""

    method: str
    args_for: Callable[[int], tuple]
    num_returns: int
    refs: dict[int, list[ray.ObjectRef]]  # the current attempt's result refs, by actor index
    retried: set[int] = field(default_factory=set)


class ActorPool:
    """The rollout actors by index, called with a deadline; see the module docstring for what a fault does."""

    def __init__(self, config: RunConfig, start_actor: Callable[[int], Any], creation_refs: Iterable[ray.ObjectRef] = ()):
        self.cfg = config.actors
        self.actors = {index: start_actor(index) for index in range(self.cfg.num_actors)}
        self.restarts = dict.fromkeys(self.actors, 0)
        # Objects the actors were created with (the layout tables): Ray re-runs an actor's constructor with them when it
        # restarts the actor, so they must live as long as the pool, not just until the actors first start.
        self.creation_refs = list(creation_refs)
        self.faults = {"faults/actor_restarts": 0.0, "faults/actor_timeouts": 0.0, "faults/dropped_actors": 0.0,
                       "faults/resampled_env_steps": 0.0}  # fmt: skip

    def call(self, method: str, args_for: Callable[[int], tuple], indices: Iterable[int] | None = None,
             num_returns: int = 1) -> dict[int, list[ray.ObjectRef]]:  # fmt: skip
        """`method(*args_for(index))` on the live actors (or those of `indices`); returns the result refs of each call
        that succeeded, by actor index. A call's first result must be small: the driver fetches it to learn whether
        the call succeeded (a receipt), and leaves any other result in the object store."""
        return self.collect(self.submit(method, args_for, indices, num_returns))

    def submit(self, method: str, args_for: Callable[[int], tuple], indices: Iterable[int] | None = None,
               num_returns: int = 1) -> PendingCall:  # fmt: skip
        """Start `call` without waiting: the actors queue it behind the calls they already have."""
        call = PendingCall(method, args_for, num_returns, {})
        for index in self.actors if indices is None else indices:
            self._attempt(call, index)
        return call

    def _attempt(self, call: PendingCall, index: int) -> None:
        refs = getattr(self.actors[index], call.method).options(num_returns=call.num_returns).remote(*call.args_for(index))
        call.refs[index] = refs if call.num_returns > 1 else [refs]

    def collect(self, call: PendingCall) -> dict[int, list[ray.ObjectRef]]:
        """Wait for a submitted call; dead actors are asked again after their restart, wedged ones killed first."""
        timeout = self.cfg.call_timeout_s
        pending = {index: refs for index, refs in call.refs.items() if index in self.actors}  # not those dropped since
        # The deadline runs from now: a call submitted ahead (policy_lag) waited behind the actor's previous one.
        since = dict.fromkeys(pending, time.monotonic())  # when each call's current attempt started
        done: dict[int, list[ray.ObjectRef]] = {}
        retried = call.retried
        while pending:
            receipts = {refs[0]: index for index, refs in pending.items()}
            wait = max(0.0, min(since[index] for index in pending) + timeout - time.monotonic())
            ready, _ = ray.wait(list(receipts), num_returns=len(receipts), timeout=wait)
            for ref, index in receipts.items():
                if ref in ready:
                    try:
                        receipt = ray.get(ref)
                    except ActorDiedError as exc:  # dead for good: Ray has no restart left for it
                        self._drop(index, f"died ({exc.__class__.__name__}) with its {self.cfg.max_restarts} restarts spent")
                        del pending[index]
                        continue
                    except OwnerDiedError as exc:  # the weights it was given were put by a learner that has died since
                        raise LearnerDiedError(f"the learner that published the weights of rollout actor {index}'s {call.method} "
                                               "call died") from exc  # fmt: skip
                    except RayActorError:  # died and restarting (or briefly unreachable): ask the restarted actor
                        retried.add(index)
                        if self._count_restarts(index, call.method):
                            since[index] = time.monotonic()  # a fresh attempt on a fresh actor
                        time.sleep(0.5)
                        self._attempt(call, index)
                        pending[index] = call.refs[index]
                        continue
                    done[index] = pending.pop(index)
                    if index in retried and isinstance(receipt, dict):
                        self.faults["faults/resampled_env_steps"] += receipt.get("env_steps", 0)
                elif time.monotonic() - since[index] >= timeout:  # wedged: kill it, Ray restarts it, ask again
                    print(f"[fault] rollout actor {index} wedged (no answer to {call.method} within actors.call_timeout_s="
                          f"{timeout:g}s): killing it", flush=True)  # fmt: skip
                    self.faults["faults/actor_timeouts"] += 1
                    ray.kill(self.actors[index], no_restart=False)
                    retried.add(index)
                    self._attempt(call, index)
                    pending[index], since[index] = call.refs[index], time.monotonic()
        for index in retried & set(self.actors):
            self._count_restarts(index, call.method)
        return done

    def _count_restarts(self, index: int, method: str) -> bool:
        """Take actor `index`'s restart count from Ray's actor table (Ray restarts it; this only keeps the books).
        True when it went up."""
        restarts = int(state.actors(actor_id=self.actors[index]._actor_id.hex()).get("NumRestarts", 0))
        if restarts <= self.restarts[index]:
            return False
        self.faults["faults/actor_restarts"] += restarts - self.restarts[index]
        self.restarts[index] = restarts
        print(f"[fault] rollout actor {index} restarted ({restarts}/{self.cfg.max_restarts} restarts): its {method} call retried",
              flush=True)  # fmt: skip
        return True

    def _drop(self, index: int, failure: str) -> None:
        """Go on without actor `index`; below actors.min_alive actors, stop."""
        del self.actors[index]
        self.faults["faults/dropped_actors"] += 1
        message = f"rollout actor {index} {failure} (actors.max_restarts): dropped"
        if len(self.actors) < self.cfg.min_alive:
            raise ActorsExhaustedError(f"{message}; {len(self.actors)} left, below actors.min_alive={self.cfg.min_alive}")
        warnings.warn(f"{message}; training goes on with the {len(self.actors)} left", RuntimeWarning, stacklevel=3)

    def submit_sample(self, weights_ref: ray.ObjectRef, iteration: int) -> PendingCall:
        """Every live actor's rollout of `iteration` with the weights of `weights_ref`, started."""
        return self.submit("sample_with_receipt", lambda index: (weights_ref, iteration), num_returns=2)

    def collect_sample(self, call: PendingCall) -> list[ray.ObjectRef]:
        """The rollouts of a submitted sample call (refs, in actor order)."""
        results = self.collect(call)
        return [results[index][1] for index in sorted(results)]

    def submit_evaluate(self, weights_ref: ray.ObjectRef, eval_layouts: list, todo: np.ndarray | None = None) -> PendingEvaluation:
        """Start a deterministic held-out evaluation without waiting, the layouts of `todo` (by default all) split across
        the live actors: they run it after the calls they already have, so the learner goes on training meanwhile."""
        todo = np.arange(len(eval_layouts)) if todo is None else todo
        shares = {index: share for index, share in zip(sorted(self.actors), np.array_split(todo, len(self.actors))) if len(share)}
        layouts_of = {index: [eval_layouts[i] for i in share] for index, share in shares.items()}
        call = self.submit("evaluate", lambda index: (weights_ref, layouts_of[index]), indices=shares)
        return PendingEvaluation(call, shares, weights_ref, eval_layouts, np.zeros(len(eval_layouts), dtype=bool), set())

    def collect_evaluate(self, pending: PendingEvaluation) -> tuple[np.ndarray, set[int]]:
        """Wait for a submitted evaluation; the share of an actor dropped meanwhile is dealt out again."""
        results = self.collect(pending.call)
        for index, (ref,) in results.items():
            version, values = ray.get(ref)
            pending.successes[pending.shares[index]] = values
            pending.versions.add(version)
        todo = [pending.shares[index] for index in pending.shares if index not in results]
        if todo:
            again = self.submit_evaluate(pending.weights_ref, pending.eval_layouts, np.concatenate(todo))
            again.successes, again.versions = pending.successes, pending.versions
            return self.collect_evaluate(again)
        return pending.successes, pending.versions

    @staticmethod
    def finished(call: PendingCall) -> bool:
        """Whether every actor has answered a submitted call (an answer may be an error that collect handles)."""
        receipts = [refs[0] for refs in call.refs.values()]
        return len(ray.wait(receipts, num_returns=len(receipts), timeout=0)[0]) == len(receipts)


@dataclass
class PendingEvaluation:
    """A held-out evaluation submitted to the actors (ActorPool.submit_evaluate), and what it has gathered."""

    call: PendingCall
    shares: dict[int, np.ndarray]  # actor index -> indices of its layouts
    weights_ref: ray.ObjectRef
    eval_layouts: list
    successes: np.ndarray  # (layouts,) bool, filled in as the actors answer
    versions: set[int]


# ---------------------------------------------------------------------------------------------- start-up


def preflight(config: RunConfig, address: str | None, resume: bool) -> list:
    """Every check that needs no Ray and no run directory, so bad input is refused before anything is written.
    Returns the held-out layouts."""
    try:
        eval_layouts = layouts(config.env.task, config.env.eval_benchmark_seeds)[: config.eval_episodes]
        layouts(config.env.task, config.env.train_benchmark_seeds)
    except ValueError as exc:
        raise ConfigError(f"env.task: {exc}") from None
    if len(eval_layouts) < config.eval_episodes:
        raise ConfigError(f"eval_episodes={config.eval_episodes} but env.eval_benchmark_seeds give only {len(eval_layouts)} layouts")
    if config.init_checkpoint is not None and not resume:  # a resumed run loads its own checkpoint
        check_checkpoint_matches(config, Path(config.init_checkpoint))
    local = not (address or os.environ.get("RAY_ADDRESS") or node_cluster_address())
    if local:  # the machine this runs on is the whole cluster: check the request against it now
        if (config.actors.num_gpus > 0 or config.learner.num_gpus > 0) and not torch.cuda.is_available():
            raise ConfigError(f"actors.num_gpus={config.actors.num_gpus} / learner.num_gpus={config.learner.num_gpus} ask for GPUs "
                              "but this machine has none (torch.cuda.is_available() is False): set them to 0, or join a GPU cluster "
                              "with --address")  # fmt: skip
        check_actor_cpus(config, actor_request(config, [float(os.cpu_count() or 1)]))
    return eval_layouts


def check_checkpoint_matches(config: RunConfig, checkpoint: Path) -> None:
    """The run's policy section must describe the checkpoint's network (its architecture comes from the file)."""
    if not (checkpoint / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"init checkpoint {checkpoint} has no {WEIGHTS_FILE}: expected a directory written by save_pretrained")
    stored = read_policy_config(checkpoint)
    sampling = set(config.policy.SAMPLING_FIELDS)
    differ = {name: (getattr(stored, name), getattr(config.policy, name))
              for name in ("type", "obs_dim", "action_dim", "chunk_size", "image_size")
              if name not in sampling and getattr(stored, name) != getattr(config.policy, name)}  # fmt: skip
    if differ:
        listing = "; ".join(f"policy.{k}: checkpoint {old!r}, config {new!r}" for k, (old, new) in differ.items())
        raise ConfigError(f"the config disagrees with the checkpoint {checkpoint}: {listing}. Make the config match the checkpoint")


def check_actor_cpus(config: RunConfig, request: ResourceRequest) -> None:
    if request.num_cpus < MIN_CPUS_PER_ACTOR and config.actors.num_gpus == 0:
        raise ConfigError(
            f"actors.num_actors={config.actors.num_actors} leaves each actor {request.num_cpus:.3g} CPU on this cluster (< "
            f"{MIN_CPUS_PER_ACTOR}): use fewer actors and more actors.envs_per_actor, or a bigger cluster"
        )


def resolve_init_checkpoint(config: RunConfig) -> Path | None:
    """The policy directory to fine-tune: the configured one, else the cached BC checkpoint (built on first use)."""
    if config.init_checkpoint is None:
        return None if config.allow_random_init else ensure_bc_checkpoint(config)
    checkpoint = Path(config.init_checkpoint)
    check_checkpoint_matches(config, checkpoint)
    return checkpoint


def plan_resources(config: RunConfig) -> tuple[ResourceRequest, ResourceRequest]:
    """What the learner and each actor ask of the Ray cluster joined; refuses what the cluster cannot give."""
    resources = ray.cluster_resources()
    node_cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]]
    learner, actor = learner_request(config, sum(node_cpus)), actor_request(config, node_cpus)
    for section, request in (("learner", learner), ("actors", actor)):
        missing = {k: v for k, v in request.amounts().items() if k != "CPU" and resources.get(k, 0) < v}
        if missing:  # Ray would leave the actor pending forever
            raise ConfigError(f"{section} asks for {missing} ({section}.num_gpus / {section}.resources) but the Ray cluster "
                              f"offers {resources}: change them, or start nodes that declare them (cluster YAML min_workers)")  # fmt: skip
    check_actor_cpus(config, actor)
    return learner, actor


def start_learner(config: RunConfig, checkpoint: Path | None, resume_dir: Path | None, request: ResourceRequest) -> Any:
    return (
        ray.remote(LearnerActor)
        .options(**request.options(bundle_index=LEARNER_BUNDLE))
        .remote(
            config,
            None if checkpoint is None else str(checkpoint),
            None if resume_dir is None else str(resume_dir),
            niceness=os.getpriority(os.PRIO_PROCESS, 0),
        )
    )


def build_benchmark_tables(config: RunConfig) -> list[ray.ObjectRef]:
    """Every actor needs the same layouts, each benchmark seed simulated once (0.7 s per seed): built by Ray tasks
    while the learner and the actors start, a group of seeds per task, one task per 4 cores (at least one), so that
    the building does not crowd out the start-up it hides behind. The tasks ask for no CPU: the run's placement group
    holds the cluster's CPUs, and a task that waited for one would never run. Seeds this process holds already (an
    earlier run in it: start_actors adopts what the tasks built) or reads from the layout cache (common.envs: every
    run after a machine's first) go through one put instead. The actors take the list unresolved (Ray resolves only
    top-level refs) and read it when their envs need it."""
    seeds = list(dict.fromkeys([*config.env.train_benchmark_seeds, *config.env.eval_benchmark_seeds]))
    held = held_benchmark_tasks(config.env.task, seeds)
    missing = [seed for seed in seeds if (config.env.task, seed) not in held]
    refs = [ray.put(held)] if held else []
    if missing:
        tasks = max(1, min(len(missing), int(ray.cluster_resources().get("CPU", 1)) // 4))
        build = ray.remote(benchmark_task_tables).options(num_cpus=0)
        refs += [build.remote(config.env.task, missing[group::tasks]) for group in range(tasks)]
    return refs


def start_actors(config: RunConfig, checkpoint_dir: str, request: ResourceRequest) -> ActorPool:
    remote_actor = ray.remote(RolloutActor)
    tables = build_benchmark_tables(config)

    def start(index: int) -> Any:
        options = request.options(bundle_index=FIRST_ACTOR_BUNDLE + index)
        return remote_actor.options(**options, max_restarts=config.actors.max_restarts).remote(
            config, index, checkpoint_dir, tables, niceness=ACTOR_NICENESS
        )

    pool = ActorPool(config, start, creation_refs=tables)
    # Wait until every actor is up (timings start clean). Not a pool call: start-up (a SmolVLA actor loads for
    # minutes) is no part of actors.call_timeout_s, and an actor that fails to start fails the run with its error.
    ray.get([actor.__ray_ready__.remote() for actor in pool.actors.values()])
    adopt_benchmark_tasks({key: tasks for part in ray.get(tables) for key, tasks in part.items()})  # for a later run here
    return pool


# ---------------------------------------------------------------------------------------------- the loop


def train(config: RunConfig, directory: RunDirectory, resume_dir: Path | None, eval_layouts: list, *, single_batch: bool = False,
          began: float | None = None, startup: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """The run, on the Ray that learner.main.run connected; began: when the run started (time.perf_counter), counted
    in its start-up time and cost (default: now); startup: the STARTUP_STAGES passed before train, in seconds since
    `began` (learner.main.run's Ray and input checks)."""
    wall_start = time.perf_counter() if began is None else began
    startup = dict(startup or {})

    def reached(stage: str) -> None:
        startup.setdefault(stage, time.perf_counter() - wall_start)

    run_dir = directory.path
    resume = resume_dir is not None
    # A resumed run loads everything from its own checkpoint: never rebuild or re-read the initial one.
    checkpoint = None if resume_dir else resolve_init_checkpoint(config)

    learner_resources, actor_resources = plan_resources(config)
    print(banner(config, checkpoint, resume_dir, ray.cluster_resources(), actor_resources.num_cpus), flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        check_ratio_sensitivity(num_log_prob_elements(build_policy(config.policy)), config.policy.sigma_min,
                                config.policy.log_prob_normalization, config.learner.clip_eps)  # fmt: skip
    learner = start_learner(config, checkpoint, resume_dir, learner_resources)
    # When the learner is up, noted as it happens (the actors start meanwhile); its failure surfaces at its first call.
    learner.__ray_ready__.remote().future().add_done_callback(lambda _: reached("learner_ready"))
    actor_checkpoint = str(resume_dir or checkpoint) if (resume_dir or checkpoint) else None
    if actor_checkpoint is None:  # random-init run: actors start from the learner's random weights, saved for them
        actor_checkpoint = learner_get(learner.save.remote(str(run_dir / "checkpoints" / "random_init")))
    pool = start_actors(config, actor_checkpoint, actor_resources)
    reached("actors_ready")
    start_iteration, total_env_steps = learner_get(learner.progress.remote())
    # The weights of iterations start_iteration, ..., + policy_lag, submitted once the loop starts; then each update's.
    sampling_refs = deque(learner_get(learner.publish_in_flight.remote()))
    weights_ref = sampling_refs[-1]
    reached("learner_ready")  # a learner whose callback has not run yet was up before progress() answered
    reached("weights_published")
    print(f"[start] {len(pool.actors)} rollout actors and the learner up in {startup['weights_published']:.1f}s "
          f"({format_startup(startup)})", flush=True)  # fmt: skip

    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    wandb_run = None if single_batch else init_wandb(config, run_dir, resume)
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if resume and summary_path.is_file() else {}

    # What the run costs: the resources it holds (reserved, busy or idle) times wall time, start-up included, summed
    # over the sessions of a resumed run. Reported per iteration (cost/...) and in summary.json.
    cost = {key: float(summary.get("cost", {}).get(key, 0.0)) for key in ("wall_seconds", "cpu_seconds_reserved", "gpu_seconds_reserved")}
    cost_clock = wall_start

    def charge() -> dict[str, float]:
        nonlocal cost_clock
        now = time.perf_counter()
        held = len(pool.actors)
        cost["wall_seconds"] += now - cost_clock
        cost["cpu_seconds_reserved"] += (learner_resources.num_cpus + actor_resources.num_cpus * held) * (now - cost_clock)
        cost["gpu_seconds_reserved"] += (learner_resources.num_gpus + actor_resources.num_gpus * held) * (now - cost_clock)
        cost_clock = now
        return {f"cost/{key}": value for key, value in cost.items()}

    def finish_eval(evaluation: PendingEvaluation, label: str, submitted: float) -> dict[str, float]:
        t0 = time.perf_counter()
        successes, versions = pool.collect_evaluate(evaluation)
        result = eval_metrics(successes, eval_layouts)
        result["eval/wait_seconds"] = time.perf_counter() - t0  # what the driver spent blocked on it
        print(f"[eval:{label}] held-out {format_eval(result)}, weights v{sorted(versions)}, {time.perf_counter() - submitted:.1f}s "
              f"after submission ({result['eval/wait_seconds']:.1f}s waited)", flush=True)  # fmt: skip
        return result

    def run_eval(label: str) -> dict[str, float]:
        return finish_eval(pool.submit_evaluate(weights_ref, eval_layouts), label, time.perf_counter())

    # Held-out evaluations do not stop training: one is submitted to the actors after its iteration's weights are
    # published and collected once finished, while the learner trains on. Rows are written in iteration order, so
    # an evaluated iteration's row (and those after it) waits for its evaluation.
    held: deque[tuple[dict[str, float], tuple[PendingEvaluation, str, float] | None]] = deque()

    def write_rows(wait: bool) -> None:
        """Write the held rows in order; a row whose evaluation is unfinished stops there, unless `wait`."""
        while held:
            row, evaluation = held[0]
            if evaluation is not None:
                if not wait and not pool.finished(evaluation[0].call):
                    return
                row.update(finish_eval(*evaluation))
            held.popleft()
            metrics_log.write(row)
            learner.export_gauges.remote(row)
            if wandb_run is not None:
                wandb_run.log(row, step=int(row["iteration"]))
            print(console_line(row), flush=True)
            if single_batch:
                print(json.dumps(row, indent=1, sort_keys=True), flush=True)

    if start_iteration == 0:  # a resumed run keeps the manifest of the run it continues
        summary["manifest"] = reproducibility_manifest(config, checkpoint, eval_layouts)
    if start_iteration == 0 and not single_batch:
        summary["initial_eval"] = run_eval("initial policy")
        reached("initial_evaluation")
        summary_path.write_text(json.dumps(summary, indent=2))  # kept if the run is interrupted

    def save(iteration: int) -> None:
        name = f"iter_{iteration:06d}"
        learner_get(learner.save.remote(str(run_dir / "checkpoints" / name)))
        directory.write_latest(name)

    last_saved = iteration = start_iteration
    learner_restarts = 0
    in_flight: deque[PendingCall] = deque()  # sample calls of iterations iteration, iteration + 1, ... (policy_lag + 1 at most)
    try:
        while iteration < config.iterations:
            t0 = time.perf_counter()
            try:
                while len(in_flight) <= config.actors.policy_lag and iteration + len(in_flight) < config.iterations:
                    ref = sampling_refs.popleft() if sampling_refs else weights_ref
                    in_flight.append(pool.submit_sample(ref, iteration + len(in_flight)))
                batch_refs = pool.collect_sample(in_flight.popleft())
                if "first_rollout" not in startup:
                    reached("first_rollout")
                    summary["startup"] = in_time_order(startup)
                    print(f"[start] first rollout in {startup['first_rollout']:.1f}s ({format_startup(startup)})", flush=True)
                metrics = learner_get(learner.update.remote(*batch_refs, verbose=single_batch))
                weights_ref = learner_get(learner.publish.remote())[0]
                iteration_seconds = time.perf_counter() - t0
                done = iteration + 1 == config.iterations
                evaluation = None
                if not single_batch and (done or (config.eval_every and (iteration + 1) % config.eval_every == 0)):
                    evaluation = (pool.submit_evaluate(weights_ref, eval_layouts), f"iteration {iteration + 1}", time.perf_counter())
                if done or (iteration + 1) % config.checkpoint_every == 0:
                    save(iteration + 1)
                    last_saved = iteration + 1
            except LearnerDiedError as exc:
                learner_restarts += 1
                if learner_restarts > config.learner.max_restarts:
                    raise LearnerDiedError(f"the learner died {learner_restarts} times (learner.max_restarts="
                                           f"{config.learner.max_restarts}); last: {exc}") from exc  # fmt: skip
                # From the run's latest checkpoint; before the first one, from what the run started with.
                restart_dir = directory.latest_checkpoint() if last_saved > 0 else resume_dir
                print(f"[fault] the learner died ({exc}): restarting it ({learner_restarts}/{config.learner.max_restarts}) from "
                      f"{restart_dir or checkpoint or 'its random initialisation'}", flush=True)  # fmt: skip
                learner = start_learner(config, None if restart_dir else checkpoint, restart_dir, learner_resources)
                iteration, total_env_steps = learner_get(learner.progress.remote())
                # The calls in flight are dropped and submitted again with the versions the checkpoint kept for them.
                sampling_refs = deque(learner_get(learner.publish_in_flight.remote()))
                weights_ref = sampling_refs[-1]
                in_flight.clear()
                continue
            total_env_steps += int(metrics["rollout/env_steps"])
            metrics.update({"iteration": iteration + 1, "rollout/total_env_steps": total_env_steps,
                            "time/iteration_seconds": iteration_seconds,
                            "time/env_steps_per_second": metrics["rollout/env_steps"] / iteration_seconds,
                            "time/wall_seconds": time.perf_counter() - wall_start,
                            "faults/learner_restarts": float(learner_restarts), "rollout/actors": float(len(pool.actors)),
                            **pool.faults, **actor_health(pool.actors), **charge()})  # fmt: skip
            held.append((metrics, evaluation))
            write_rows(wait=done)
            iteration += 1
    except BaseException as exc:  # Ctrl-C, SIGTERM, or an unexpected error: keep what the learner has done
        for row, _ in held:  # rows of completed iterations are kept; their unfinished evaluations are not
            metrics_log.write(row)
        save_progress(learner, save, last_saved, exc)
        raise

    rows = metrics_log.read()
    final_eval = {k: rows[-1][k] for k in rows[-1] if k.startswith("eval/")} if rows else {}
    summary.update({"iterations": config.iterations, "env_steps": total_env_steps, "final_eval": final_eval,
                    "wall_seconds_this_session": time.perf_counter() - wall_start, "config_fingerprint": config.fingerprint(),
                    "init_checkpoint": str(checkpoint) if checkpoint else summary.get("init_checkpoint"),
                    "faults": {**pool.faults, "faults/learner_restarts": float(learner_restarts)}})  # fmt: skip
    charge()
    summary["cost"] = {**cost, "env_steps": total_env_steps, "gpu_hours_reserved": cost["gpu_seconds_reserved"] / 3600}
    if "initial_eval" in summary and final_eval:
        summary["success_gain"] = final_eval["eval/success_rate"] - summary["initial_eval"]["eval/success_rate"]
    summary_path.write_text(json.dumps(summary, indent=2))
    if rows and not single_batch:
        title = f"{config.env.task}: {config.learner.algo.upper()} fine-tuning"
        summary["curve"] = str(plot_learning_curve(rows, run_dir / "learning_curve.png", title, summary.get("initial_eval")))
        print_summary(summary)
    if wandb_run is not None:
        wandb_run.finish()
    return summary


def save_progress(learner: Any, save: Callable[[int], None], last_saved: int, error: BaseException) -> None:
    """Checkpoint the iterations completed since the last checkpoint, if the learner is still there to save them."""
    try:
        completed, _ = ray.get(learner.progress.remote(), timeout=60)
        if completed > last_saved:
            save(completed)
            what = "interrupted" if isinstance(error, KeyboardInterrupt) else f"stopped by {type(error).__name__}"
            print(f"\n[{what}] saved iter_{completed:06d}; continue with --resume", flush=True)
    except Exception as exc:  # the learner is gone or wedged: nothing more can be kept
        print(f"[fault] could not save the learner's progress ({type(exc).__name__}): --resume continues from the last checkpoint",
              flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------- output


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
    lines.append(f"update             : {update_shape(config)}")
    lines.append("=" * 78)
    return "\n".join(lines)


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


# What a run's start-up passes through, in seconds since learner.main.run began (summary.json "startup", the "[start]"
# lines): Ray connected, the input checked (beside Ray's start), the learner and all the rollout actors constructed,
# the first weights published, the initial policy's held-out evaluation (a full run), and the first rollout collected.
STARTUP_STAGES = {"ray_up": "Ray", "input_checked": "input checked", "learner_ready": "learner", "actors_ready": "actors",
                  "weights_published": "weights published", "initial_evaluation": "initial evaluation",
                  "first_rollout": "first rollout"}  # fmt: skip


def in_time_order(startup: dict[str, float]) -> dict[str, float]:
    """The stages passed, in the order they were passed (the callbacks of learner.main.run and train note some late)."""
    return dict(sorted(startup.items(), key=lambda item: item[1]))


def format_startup(startup: dict[str, float]) -> str:
    """The stages passed, in order: "Ray 5.2s, input checked 5.3s, ..."."""
    return ", ".join(f"{STARTUP_STAGES[stage]} {seconds:.1f}s" for stage, seconds in in_time_order(startup).items())


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
