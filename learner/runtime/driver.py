"""The training loop behind `python -m learner.main`, and what keeps it going when parts of it fail.

Orchestration only: start the learner and the rollout actors (learner.runtime.startup), then loop: sample -> update ->
publish -> evaluate/checkpoint -> report (learner.runtime.reporting). With actors.policy_lag = L > 0 the sampling of the
next L iterations is submitted before each update, so the actors sample with the versions before it while the
learner trains (learner.update.learner explains how the update accounts for the lag). The math lives in common/, the
optimisation in learner/update/learner.py, the sampling in actors/. Weights flow one way as versioned state (one `ray.put`
per version by the learner, every actor reads the same reference); rollouts flow the other way as typed numpy
records, straight from the actors into the learner (their object refs are passed to the learner's update, not
through the driver).

Faults, and what each costs:
- A rollout actor that dies or wedges is restarted and its call retried, for exactly the samples the failed attempt
  would have given; one out of restarts is dropped (learner.runtime.actor_pool).
- A learner that dies or wedges is started again from the run's latest checkpoint and the iterations since are
  redone, identically (learner.runtime.learner_handle). Rollouts in flight (policy_lag > 0) are dropped and sampled again
  with the versions that sampled them first, which the checkpoint keeps (as on --resume), so the redone iterations
  are the same at any lag.
- A NaN/Inf update is rolled back and skipped inside the learner (learner.update.learner.Learner.update).
- Any other error, Ctrl-C or SIGTERM first saves the learner's progress as a checkpoint, if it is alive.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import ray

from common.config import RunConfig
from common.console import log
from common.metrics import MetricsLog
from common.storage import RunFileWriteError
from common.suites import make_suite
from learner.files.run_dir import RunDirectory, completed_iterations
from learner.runtime.actor_pool import ActorPool, PendingCall
from learner.runtime.failures import LearnerDiedError, stops_held
from learner.runtime.learner_handle import LearnerHandle
from learner.runtime.reporting import CostMeter, EvaluationFilms, Evaluator, MetricsRows, RunSummary, StallWatch, banner, init_wandb
from learner.runtime.startup import (
    StartupClock,
    describe_task_weights,
    plan_resources,
    resolve_init_checkpoint,
    start_actors,
    warn_of_config_traps,
    with_solved_task_weights,
)


def train(
    config: RunConfig,
    directory: RunDirectory,
    resume_dir: Path | None,
    eval_layouts: list,
    *,
    single_batch: bool = False,
    began: float | None = None,
    startup: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run, on the Ray that learner.main.run connected; began: when the run started (time.perf_counter), counted
    in its start-up time and cost (default: now); startup: the STARTUP_STAGES passed before train, in seconds since
    `began` (learner.main.run's Ray and input checks)."""
    clock = StartupClock(began, startup)
    # A resumed run loads everything from its own checkpoint: never rebuild or re-read the initial one.
    checkpoint = None if resume_dir else resolve_init_checkpoint(config)
    if resume_dir is None:
        clock.reached("initial_policy")
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # shown at every run's start, like the ratio warning
        directory.warn_if_checkpoints_outgrow_the_disk(config, resume_dir or checkpoint, completed_iterations(resume_dir))
    learner_resources, actor_resources = plan_resources(config)
    log.info(banner(config, checkpoint, resume_dir, ray.cluster_resources(), actor_resources.num_cpus))
    warn_of_config_traps(config)
    learner = LearnerHandle(config, directory, checkpoint, resume_dir, learner_resources)
    learner.when_ready(lambda: clock.reached("learner_ready"))  # noted as it happens: the actors start meanwhile
    summary = RunSummary(directory, resume=resume_dir is not None)
    # The rollout envs per task: chosen at a run's start (from its starting checkpoint) and kept when it resumes.
    actor_config = with_solved_task_weights(config, checkpoint, summary.data.get("task_weights") if resume_dir else None)
    summary.data["task_weights"] = actor_config.env.task_weights
    if weights_line := describe_task_weights(actor_config):
        log.info(weights_line)
    pool = start_actors(actor_config, learner.initial_weights(), actor_resources)
    clock.reached("actors_ready")
    iteration, env_steps = learner.resume_point()
    if learner.call("files_elsewhere"):  # actors.run_files
        log.info(
            f"[start] the learner runs on another node than this driver, which keeps the run directory {directory.path}: "
            "the learner reads its starting checkpoint from here and writes its checkpoints here through Ray's object store"
        )
    rollouts = RolloutQueue(pool, config, learner.publish_in_flight())
    clock.reached("learner_ready", "weights_published")  # a learner whose callback has not run yet was up by now
    log.info(f"[start] {len(pool.actors)} rollout actors and the learner up in {clock.stages['weights_published']:.1f}s ({clock})")

    cost = CostMeter(clock.began, learner_resources.times(config.learner.num_learners), actor_resources, summary.data.get("cost", {}))
    wandb_run = None if single_batch else init_wandb(config, directory.path, resume_dir is not None)
    films = EvaluationFilms(config, pool, eval_layouts, directory.path, wandb_run) if config.eval_videos else None
    evaluator = Evaluator(pool, eval_layouts, films)
    rows = MetricsRows(MetricsLog(directory.path / "metrics.jsonl"), evaluator, learner, wandb_run, single_batch)
    rows.recover(completed_iterations(resume_dir))
    stalls = StallWatch(config.stall_window if len(make_suite(config.env).tasks()) > 1 else 0, config.stall_compare)
    stalled: dict[str, int] = {}  # named stalled, their demonstrations not yet with the learner (algorithm.stall_demos)
    try:
        if iteration == 0:  # a resumed run keeps the manifest and the initial evaluation of the run it continues
            summary.begin(config, checkpoint, eval_layouts)
            if not single_batch:
                summary.note_initial_eval(evaluator.run(rollouts.weights_ref, "initial policy", iteration))
                clock.reached("initial_evaluation")
        while iteration < config.iterations:
            t0 = time.perf_counter()
            try:
                if stalled:
                    summary.note_stall_demonstrations(learner.add_demonstrations(stalled), iteration, config)
                    stalled = {}
                batch_refs = rollouts.collect(iteration)
                summary.note_first_rollout(clock)
                with stops_held("finishing the update and logging it"):  # the learner finishes it whatever happens here
                    metrics = learner.update(batch_refs, verbose=single_batch)
                    rollouts.publish(learner.publish())
                    iteration_seconds = time.perf_counter() - t0
                    done = iteration + 1 == config.iterations
                    due = not single_batch and (done or (config.eval_every and (iteration + 1) % config.eval_every == 0))
                    evaluation = evaluator.submit(rollouts.weights_ref, f"iteration {iteration + 1}", iteration + 1) if due else None
                    env_steps += int(metrics["rollout/env_steps"])
                    metrics.update(
                        {
                            "iteration": iteration + 1,
                            "rollout/total_env_steps": env_steps,
                            "time/iteration_seconds": iteration_seconds,
                            "time/env_steps_per_second": metrics["rollout/env_steps"] / iteration_seconds,
                            "time/wall_seconds": clock.elapsed(),
                            "faults/learner_restarts": float(learner.restarts),
                            "rollout/actors": float(len(pool.actors)),
                            **pool.faults,
                            **pool.health(),
                            **cost.charge(len(pool.actors)),
                        }
                    )
                    if done or (iteration + 1) % config.checkpoint_every == 0:
                        rows.keep_held(metrics)  # on disk before the checkpoint passes them
                        learner.save(iteration + 1)
                    rows.add(metrics, evaluation, wait=done)  # an evaluation still fetching the weights dies with their learner
            except LearnerDiedError as failure:  # a new learner, from the latest checkpoint: the iterations since are redone
                iteration, env_steps = learner.restart(failure)
                rollouts.restart(learner.publish_in_flight())
                rows.after_learner_restart(iteration, rollouts.weights_ref)
                continue
            iteration += 1
            named = stalls.check(iteration, rows.completed)
            if config.algorithm.stall_demos:
                stalled.update(dict.fromkeys(named, iteration))
    except BaseException as exc:  # Ctrl-C, SIGTERM, or an unexpected error: keep what the learner has done
        if not isinstance(exc, RunFileWriteError):  # else the disk refused a row: a checkpoint past it would lose that row
            rows.keep_completed()
            learner.save_progress(exc)
        learner.close()
        raise

    logged, faults = rows.log.read(), {**pool.faults, "faults/learner_restarts": float(learner.restarts)}
    summary.finish(config, logged, env_steps, clock.elapsed(), checkpoint, faults, cost.final(len(pool.actors)))
    rows.close()  # the last films saved and wandb's closing lines printed first: the summary is the last thing on screen
    if logged and not single_batch:
        summary.plot_and_print(config, logged, directory.path)
    learner.close()
    return summary.data


class RolloutQueue:
    """The sample calls submitted ahead of the update (actors.policy_lag of them), and the weights each samples with.

    The weights of iterations k, ..., k + policy_lag come from the learner at its (re)start (publish_in_flight: the
    versions that sampled them first, which a checkpoint keeps); every later iteration samples with the newest
    weights published."""

    def __init__(self, pool: ActorPool, config: RunConfig, weights_refs: list[ray.ObjectRef]):
        self.pool, self.policy_lag, self.iterations = pool, config.actors.policy_lag, config.iterations
        self.in_flight: deque[PendingCall] = deque()  # sample calls of iterations k, k + 1, ... (policy_lag + 1 at most)
        self.restart(weights_refs)

    def restart(self, weights_refs: list[ray.ObjectRef]) -> None:
        """Drop the calls in flight; the next iterations sample with `weights_refs`, then with what is published."""
        self.in_flight.clear()
        self.waiting = deque(weights_refs)
        self.weights_ref = weights_refs[-1]  # the newest weights: what the next evaluation and later rollouts use

    def publish(self, weights_ref: ray.ObjectRef) -> None:
        self.weights_ref = weights_ref

    def collect(self, iteration: int) -> list[ray.ObjectRef]:
        """Iteration `iteration`'s rollouts (refs, in actor order), once the sampling of the next policy_lag is submitted."""
        while len(self.in_flight) <= self.policy_lag and iteration + len(self.in_flight) < self.iterations:
            weights_ref = self.waiting.popleft() if self.waiting else self.weights_ref
            self.in_flight.append(self.pool.submit_sample(weights_ref, iteration + len(self.in_flight)))
        return self.pool.collect_sample(self.in_flight.popleft())
