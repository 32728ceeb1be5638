"""A run's start-up: the input checked before Ray is needed, the resources planned, the learner and the rollout
actors started, and the clock of the stages the start-up passes (summary.json "startup", the "[start]" lines)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import ray
import torch

from actors.rollout_actor import RolloutActor
from actors.run_files import RunFiles
from common.config import ConfigError, RunConfig
from common.diagnostics import check_ratio_sensitivity, check_rollout_length
from common.file_digests import known_digests
from common.flow import num_log_prob_elements, require_kernel_compiler
from common.lerobot_checkpoint import check_features, is_lerobot_checkpoint
from common.lerobot_dataset import check_dataset
from common.policy import WEIGHTS_FILE, read_policy_config, verify_checksums
from common.rollout import run_group_tasks
from common.suites import build_layout_tables, make_suite
from learner.bc.starting_checkpoint import ensure_bc_checkpoint, lerobot_start_checkpoint
from learner.bc.training import REPORT_FILE, check_task_demos
from learner.runtime.actor_pool import ActorPool
from learner.runtime.learner_actor import LearnerActor
from learner.runtime.learner_group import LearnerRanks, start_learner_group
from learner.runtime.ray_runtime import (
    FIRST_ACTOR_BUNDLE,
    LEARNER_BUNDLE,
    ResourceRequest,
    actor_request,
    learner_request,
    node_cluster_address,
)

MIN_CPUS_PER_ACTOR = 0.05  # below this, actors time-share a core so thinly that the run crawls: a config mistake
# The rollout actors' scheduling niceness. At policy_lag 1 the learner's update (one thread) runs while the actors
# sample, and it is the iteration's critical path: with the actors at a lower priority the learner gets a core
# whenever it works, and the actors every cycle it leaves (docs/performance.md, "The learner first"). The same
# arithmetic either way: only the order of who runs changes.
ACTOR_NICENESS = 19


def preflight(config: RunConfig, address: str | None, resume: bool) -> list:
    """Every check that needs no Ray and no run directory, so bad input is refused before anything is written.
    Returns the held-out layouts."""
    if config.init_checkpoint is not None and not resume and not is_lerobot_checkpoint(config.init_checkpoint):
        check_checkpoint_matches(config, Path(config.init_checkpoint))  # a resumed run loads its own checkpoint
    suite = make_suite(config.env)
    suite.check(config.policy)
    check_features(config, suite)
    if config.pretrain.dataset and config.init_checkpoint is None:  # the starting policy is cloned from it
        check_dataset(Path(config.pretrain.dataset).expanduser(), config.policy, suite)
    tasks = suite.tasks()
    check_task_demos(config.pretrain, tasks)
    missing = [task for task in tasks if suite.expert(task) is None] if config.algorithm.stall_demos and len(tasks) > 1 else []
    if missing:
        raise ConfigError(
            f"algorithm.stall_demos gives a stalled task scripted demonstrations, but {suite.name} has no scripted expert "
            f"for {missing}: set algorithm.stall_demos: 0"
        )
    eval_layouts = suite.held_out(config.eval_episodes)
    if len(eval_layouts) < config.eval_episodes * len(tasks):
        raise ConfigError(
            f"eval_episodes={config.eval_episodes} but env.eval_benchmark_seeds give only "
            f"{len(eval_layouts) // len(tasks)} layouts per task"
        )
    group = config.algorithm.group_size if config.algorithm.algo == "grpo" else 1
    groups = config.actors.num_actors * config.actors.envs_per_actor // group
    strangers = sorted(set(config.env.task_weights) - set(tasks))
    if strangers:
        raise ConfigError(f"env.task_weights names {strangers}, not tasks of env.task={config.env.task} ({tasks})")
    weighted = config.env.task_weights or config.env.solved_task_weight != 1.0
    if weighted and groups < len(tasks):
        raise ConfigError(
            f"actors.num_actors x actors.envs_per_actor make {groups} env groups for the {len(tasks)} tasks of "
            f"env.task={config.env.task}: weighted tasks need at least one each"
        )
    if not weighted and groups % len(tasks):
        unit = "envs" if group == 1 else f"GRPO groups of {group} envs"
        raise ConfigError(
            f"actors.num_actors x actors.envs_per_actor make {groups} {unit} for the {len(tasks)} tasks of "
            f"env.task={config.env.task}: every iteration samples every task equally only with a multiple of "
            f"{len(tasks)}"
        )
    local = not (address or os.environ.get("RAY_ADDRESS") or node_cluster_address())
    if local:  # the machine this runs on is the whole cluster: check the request against it now
        if (config.actors.num_gpus > 0 or config.learner.num_gpus > 0) and not torch.cuda.is_available():
            raise ConfigError(
                f"actors.num_gpus={config.actors.num_gpus} / learner.num_gpus={config.learner.num_gpus} ask for GPUs "
                "but this machine has none (torch.cuda.is_available() is False): set them to 0, or join a GPU cluster "
                "with --address"
            )
        check_actor_cpus(config, actor_request(config, [float(os.cpu_count() or 1)]))
        compiles = {
            "actors.speed.compile_steps": (config.actors.speed.compile_steps, config.actors.num_gpus),
            "actors.speed.compile_vision": (config.actors.speed.compile_vision, config.actors.num_gpus),
            "learner.speed.compile_steps": (config.learner.speed.compile_steps, config.learner.num_gpus),
            "learner.speed.compile_vision": (config.learner.speed.compile_vision, config.learner.num_gpus),
        }
        for field, (compiled, gpus) in compiles.items():
            if compiled:
                require_kernel_compiler("cuda" if gpus > 0 else "cpu", field)
    return eval_layouts


def check_checkpoint_matches(config: RunConfig, checkpoint: Path) -> None:
    """The run's policy section must describe the checkpoint's network (its architecture comes from the file)."""
    if not (checkpoint / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"init checkpoint {checkpoint} has no {WEIGHTS_FILE}: expected a directory written by save_pretrained")
    stored = read_policy_config(checkpoint)
    sampling = set(config.policy.SAMPLING_FIELDS)
    differ = {
        name: (getattr(stored, name), getattr(config.policy, name))
        for name in ("type", "obs_dim", "action_dim", "chunk_size", "image_size")
        if name not in sampling and getattr(stored, name) != getattr(config.policy, name)
    }
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
    """The policy directory to fine-tune: the configured one, else the cached BC checkpoint (built on first use); its
    checksums verified here, before the learner and the actors start (they take the digests, start_learner)."""
    if config.init_checkpoint is None or is_lerobot_checkpoint(config.init_checkpoint):
        if config.allow_random_init:
            return None
        checkpoint = ensure_bc_checkpoint(config) if config.init_checkpoint is None else lerobot_start_checkpoint(config)
        verify_checksums(checkpoint)
        return checkpoint
    checkpoint = Path(config.init_checkpoint)
    check_checkpoint_matches(config, checkpoint)
    return checkpoint


def with_solved_task_weights(config: RunConfig, checkpoint: Path | None, recorded: dict[str, float] | None) -> RunConfig:
    """The config the rollout actors run: env.task_weights, and env.solved_task_weight for each task that the starting
    checkpoint's BC evaluation (its pretrain.json, per task) puts above pretrain.target_success_max, unless task_weights
    names it. `recorded`: the weights a resumed run's start chose (summary.json), kept as they were."""
    weights = dict(config.env.task_weights)
    if recorded is not None:
        weights = recorded
    elif config.env.solved_task_weight != 1.0 and checkpoint is not None and (checkpoint / REPORT_FILE).is_file():
        per_task = json.loads((checkpoint / REPORT_FILE).read_text()).get("per_task", {})
        for task in make_suite(config.env).tasks():
            if task in per_task and task not in weights and per_task[task][0] > config.pretrain.target_success_max:
                weights[task] = config.env.solved_task_weight
    return dataclasses.replace(config, env=dataclasses.replace(config.env, task_weights=weights))


def describe_task_weights(config: RunConfig) -> str | None:
    """The rollout envs each task gets, when the tasks are weighted (None otherwise)."""
    if not config.env.task_weights:
        return None
    tasks = make_suite(config.env).tasks()
    dealt, group = run_group_tasks(config, tasks)
    counts = ", ".join(f"{task} {dealt.count(task) * group}" for task in tasks)
    return f"[start] rollout envs per task (env.task_weights {config.env.task_weights}): {counts}"


def warn_of_config_traps(config: RunConfig) -> None:
    """common.diagnostics.check_ratio_sensitivity on the run's policy, and check_rollout_length on its rollouts; their
    warnings are shown at every run's start."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        check_ratio_sensitivity(
            num_log_prob_elements(config.policy), config.policy.sigma_min, config.policy.log_prob_normalization, config.algorithm.clip_eps
        )
        check_rollout_length(config.actors.decisions_per_rollout, config.policy.chunk_size, config.env.max_episode_steps)


def plan_resources(config: RunConfig) -> tuple[ResourceRequest, ResourceRequest]:
    """What the learner and each actor ask of the Ray cluster joined; refuses what the cluster cannot give."""
    resources = ray.cluster_resources()
    node_cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]]
    learner, actor = learner_request(config, sum(node_cpus)), actor_request(config, node_cpus)
    ranks = config.learner.num_learners
    for section, request, count in (("learner", learner, ranks), ("actors", actor, 1)):
        missing = {k: v for k, v in request.times(count).amounts().items() if k != "CPU" and resources.get(k, 0) < v}
        if missing:  # Ray would leave the actor pending forever
            fields = f"{section}.num_gpus / {section}.resources" + (f", times learner.num_learners={count} ranks" if count > 1 else "")
            raise ConfigError(
                f"{section} asks for {missing} ({fields}) but the Ray cluster "
                f"offers {resources}: change them, or start nodes that declare them (cluster YAML min_workers)"
            )
    check_actor_cpus(config, actor)
    return learner, actor


def start_learner(config: RunConfig, checkpoint: Path | None, resume_dir: Path | None, request: ResourceRequest) -> LearnerRanks:
    """The learner's actors, fine-tuning `checkpoint` or continuing from `resume_dir`; with neither (a random init), given
    the suite's state bounds to normalise to, when it knows them; given the run's tasks, so that they import no
    simulator. learner.num_learners > 1: a learner group."""
    suite = make_suite(config.env)
    bounds = suite.state_bounds() if checkpoint is None and resume_dir is None else None
    args = (config, None if checkpoint is None else str(checkpoint), None if resume_dir is None else str(resume_dir))
    kwargs = {
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "known_digests": known_digests(),
        "files": RunFiles.of_this_node(),
        "state_bounds": None if bounds is None else [bound.tolist() for bound in bounds],
        "tasks": suite.tasks(),
    }
    if config.learner.num_learners > 1:
        return start_learner_group(config, request, LearnerActor, *args, **kwargs)
    return LearnerRanks([ray.remote(LearnerActor).options(**request.options(bundle_index=LEARNER_BUNDLE)).remote(*args, **kwargs)])


def build_benchmark_tables(config: RunConfig) -> list[ray.ObjectRef]:
    """Every actor needs the same layouts, each benchmark seed simulated once (50 resets each): built by Ray tasks
    while the learner and the actors start, a group of seeds per task, one task per 4 cores (at least one), so that
    the building does not crowd out the start-up it hides behind. The tasks ask for no CPU: the run's placement group
    holds the cluster's CPUs, and a task that waited for one would never run. Seeds this process holds already (an
    earlier run in it: start_actors adopts what the tasks built) or reads from the layout cache (Metaworld's: every
    run after a machine's first) go through one put instead. The actors read them through LayoutTables when their
    envs need them."""
    seeds = list(dict.fromkeys([*config.env.train_benchmark_seeds, *config.env.eval_benchmark_seeds]))
    suite = make_suite(config.env)
    held, missing = suite.held_layout_tables([(task, seed) for task in suite.tasks() for seed in seeds])
    refs = [ray.put(held)] if held else []
    if missing:
        builders = max(1, min(len(missing), int(ray.cluster_resources().get("CPU", 1)) // 4))
        build = ray.remote(build_layout_tables).options(num_cpus=0)
        refs += [build.remote(config.env, missing[group::builders]) for group in range(builders)]
    return refs


class LayoutTables:
    """The benchmark tables the start-up tasks build (build_benchmark_tables), merged and served to the rollout actors.

    Ray re-runs a restarted actor's constructor with the arguments it was first given. Object references among them
    (an actor handle holds one too) could be gone by then, and Ray says so at an error level as each actor is created.
    The rollout actors are given this actor's name instead: while the pool holds its handle, a restarted rollout actor
    finds it by that name and fetches the tables again."""

    def __init__(self, parts: list[ray.ObjectRef]):
        self.parts = parts  # nested in a list: Ray leaves them unresolved, so the actors start while the tasks build

    def merged(self) -> dict:
        return {key: tasks for part in ray.get(self.parts) for key, tasks in part.items()}


def start_actors(config: RunConfig, checkpoint_dir: str, request: ResourceRequest) -> ActorPool:
    remote_actor = ray.remote(RolloutActor)
    tables_name = f"layout-tables-{uuid.uuid4().hex}"  # one per run: several runs may share a cluster
    tables = ray.remote(LayoutTables).options(name=tables_name, num_cpus=0).remote(build_benchmark_tables(config))
    digests = known_digests()  # the checkpoint's, verified by resolve_init_checkpoint or RunDirectory.resume
    files = RunFiles.of_this_node()  # the driver's: an actor on another node fetches the checkpoint from it

    def start(index: int) -> Any:
        options = request.options(bundle_index=FIRST_ACTOR_BUNDLE + index)
        return remote_actor.options(**options, max_restarts=config.actors.faults.max_restarts).remote(
            config, index, checkpoint_dir, tables_name, niceness=ACTOR_NICENESS, known_digests=digests, files=files
        )

    pool = ActorPool(config, start, keep_alive=[tables])
    pool.wait_started()  # timings start clean
    make_suite(config.env).adopt_layout_tables(ray.get(tables.merged.remote()))  # for a later run here
    return pool


# What a run's start-up passes through, in seconds since learner.main.run began (summary.json "startup", the "[start]"
# lines): Ray connected, the input checked (beside Ray's start), the initial policy found (a fresh run: the cached BC
# checkpoint is built on first use, which can take minutes), the learner and all the rollout actors constructed, the
# first weights published, the initial policy's held-out evaluation (a full run), and the first rollout collected.
STARTUP_STAGES = {
    "ray_up": "Ray",
    "input_checked": "input checked",
    "initial_policy": "initial policy",
    "learner_ready": "learner",
    "actors_ready": "actors",
    "weights_published": "weights published",
    "initial_evaluation": "initial evaluation",
    "first_rollout": "first rollout",
}


def in_time_order(startup: dict[str, float]) -> dict[str, float]:
    """The stages passed, in the order they were passed (the callbacks of learner.main.run and train note some late)."""
    return dict(sorted(startup.items(), key=lambda item: item[1]))


def format_startup(startup: dict[str, float]) -> str:
    """The stages passed, in order: "Ray 5.2s, input checked 5.3s, ..."."""
    return ", ".join(f"{STARTUP_STAGES[stage]} {seconds:.1f}s" for stage, seconds in in_time_order(startup).items())


class StartupClock:
    """The STARTUP_STAGES a run has passed, in seconds since it began."""

    def __init__(self, began: float | None = None, passed: dict[str, float] | None = None):
        """began: when the run started (time.perf_counter; default now); passed: the stages noted before, by then."""
        self.began = time.perf_counter() if began is None else began
        self.stages = dict(passed or {})

    def reached(self, *stages: str) -> None:
        """Note each stage as passed now, unless it was noted before (a callback may note one early)."""
        for stage in stages:
            self.stages.setdefault(stage, time.perf_counter() - self.began)

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.began

    def __str__(self) -> str:
        return format_startup(self.stages)
