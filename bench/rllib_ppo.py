"""RLlib PPO on this project's task, with the main job's workers and envs: its whole-iteration env steps/s.

Runs in its own virtual environment (`ray[rllib]==2.60.0` pins gymnasium 1.2.2, which the project's does not use):

    python -m venv /work/rllib-venv
    /work/rllib-venv/bin/pip install torch==2.13.0                 # first, so that pip keeps the CPU build
    /work/rllib-venv/bin/pip install "ray[rllib]==2.60.0" metaworld==3.1.1
    /work/rllib-venv/bin/pip install --no-deps -e .               # this repo, for common.suites
    /work/rllib-venv/bin/python bench/rllib_ppo.py                 # or: python bench/throughput.py --rllib-python ...

- env: common.suites.metaworld.MetaworldTaskEnv on RunConfig().env's task, episode length, reward and stop-on-success, one action
  per env step; every reset draws one of the training layouts (env.train_benchmark_seeds) from a seeded generator.
- workers: --env-runners EnvRunner actors (default: one per core), each stepping its share of the main job's envs
  (actors.num_actors x actors.envs_per_actor) in one synchronous vector env, like a rollout actor steps its envs.
- PPO (new API stack, torch, one local learner in this process): train_batch_size = the main job's env steps per
  iteration (actors x envs x decisions_per_rollout x chunk_size), rollout_fragment_length "auto" (each env steps
  batch / envs), minibatches of the main job's minibatch size (in env steps) for algorithm.update_epochs epochs (the
  main job's optimiser steps per iteration), an MLP of --hidden units for the policy and another for the value.
- rllib_env_steps_per_second: env steps of the timed iterations (the ones after --warmup-iterations) over the sum of
  their time_this_iter_s (sampling, update, weight sync). rllib_sample_env_steps_per_second: the same steps over the
  time of PPO's sampling call alone, timed here around it: the result's own sampling timer is an exponential moving
  average over iterations (coefficient 0.01), not one iteration's time.

The adapter (make_env, TrainingLayoutEnv) imports no RLlib, so that the project's tests can check it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import gymnasium
import numpy as np

from bench.report import emit, load_average
from common.config import RunConfig
from common.suites.metaworld import Layout, MetaworldSuite, MetaworldTaskEnv

ENV_NAME = "flowrl-metaworld-training-layouts"


class TrainingLayoutEnv(gymnasium.Env):
    """MetaworldTaskEnv that draws a training layout at every reset.

    The draws come from a generator seeded with (seed, stream): `seed` is the constructor's until a reset passes
    one (gymnasium's contract: a reset's seed restarts the sequence), `stream` tells apart the EnvRunners, whose
    sub-envs RLlib seeds with consecutive integers from a per-runner base (runner i's env j+1 gets runner i+1's env j
    seed otherwise). Infos carry the layout (reset) and success (step) only, not Metaworld's per-step dict.
    """

    metadata = {"render_modes": []}

    def __init__(self, seed: int = 0, stream: int = 0, max_episode_steps: int | None = None) -> None:
        env_config = RunConfig().env
        self._layouts = MetaworldSuite(env_config).layouts(env_config.task, env_config.train_benchmark_seeds)
        self._stream = stream
        self._rng = np.random.default_rng([seed, stream])
        self._env = MetaworldTaskEnv(
            env_config.task,
            env_config.max_episode_steps if max_episode_steps is None else max_episode_steps,
            env_config.stop_on_success,
            env_config.reward,
            layout=self._layouts[0],
        )
        self.observation_space = self._env.observation_space
        self.action_space = self._env.action_space

    @property
    def layout(self) -> Layout:
        return self._env.layout

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng([seed, self._stream])
        layout = self._layouts[int(self._rng.integers(len(self._layouts)))]
        observation, _ = self._env.reset(seed=seed, options={"layout": layout})
        return observation, {"benchmark_seed": layout.benchmark_seed, "layout_index": layout.index}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        observation, reward, terminated, truncated, info = self._env.step(action)
        return observation, reward, terminated, truncated, {"success": info["success"]}

    def close(self) -> None:
        self._env.close()


def make_env(env_config: dict | None = None) -> TrainingLayoutEnv:
    """RLlib's env creator. env_config: RLlib's EnvContext (a dict with worker_index as an attribute) or a plain dict;
    keys "seed" (default 0) and "max_episode_steps" (default RunConfig().env's); the stream is the worker index."""
    env_config = env_config or {}
    stream = getattr(env_config, "worker_index", None)
    if stream is None:
        stream = env_config.get("worker_index", 0)
    return TrainingLayoutEnv(seed=int(env_config.get("seed", 0)), stream=int(stream), max_episode_steps=env_config.get("max_episode_steps"))


def main_job_shape() -> dict[str, int]:
    """The main job's default workers, envs and iteration size, from RunConfig."""
    config = RunConfig()
    envs = config.actors.num_actors * config.actors.envs_per_actor
    return {
        "envs": envs,
        "iteration_env_steps": envs * config.actors.decisions_per_rollout * config.policy.chunk_size,
        "minibatch_env_steps": config.algorithm.minibatch_sizes(envs * config.actors.decisions_per_rollout)[0] * config.policy.chunk_size,
        "update_epochs": config.algorithm.update_epochs,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    shape = main_job_shape()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12, help="PPO iterations")
    parser.add_argument("--warmup-iterations", type=int, default=2, help="first iterations left out of the figures")
    parser.add_argument("--env-runners", type=int, default=os.cpu_count() or 1, help="EnvRunner actors (default: one per core)")
    parser.add_argument("--envs", type=int, default=shape["envs"], help="envs in all (default: the main job's actors x envs per actor)")
    parser.add_argument("--train-batch-size", type=int, default=shape["iteration_env_steps"], help="env steps per iteration")
    parser.add_argument("--minibatch-size", type=int, default=shape["minibatch_env_steps"], help="env steps per optimiser step")
    parser.add_argument("--num-epochs", type=int, default=shape["update_epochs"], help="passes over each iteration's batch")
    parser.add_argument("--hidden", default="256,256", help="hidden layer sizes of the policy and value MLPs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.iterations <= args.warmup_iterations or args.warmup_iterations < 0:
        parser.error(f"--iterations ({args.iterations}) must exceed --warmup-iterations ({args.warmup_iterations}) >= 0")
    if min(args.env_runners, args.envs, args.train_batch_size, args.minibatch_size, args.num_epochs) < 1:
        parser.error("--env-runners, --envs, --train-batch-size, --minibatch-size and --num-epochs must be >= 1")
    return args


def nested(result: dict, path: str) -> Any:
    """result["a"]["b"] for "a/b"; a missing key is an error that names the keys there are."""
    value = result
    for key in path.split("/"):
        if not isinstance(value, dict) or key not in value:
            known = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"RLlib's result has no {path!r} (at {key!r}: {known})")
        value = value[key]
    return value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # RLlib only here: the adapter above stays importable where it is not installed.
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo import ppo as ppo_module
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    from learner.runtime.ray_runtime import start_local_ray

    envs_per_runner = math.ceil(args.envs / args.env_runners)
    hidden = [int(units) for units in args.hidden.split(",")]
    results: dict[str, Any] = {"rllib_load_average_1m_start": load_average()}
    start_local_ray(include_dashboard=False, num_cpus=max(os.cpu_count() or 1, args.env_runners), log_to_driver=True)
    register_env(ENV_NAME, make_env)
    config = (
        PPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .framework("torch")
        .environment(ENV_NAME, env_config={"seed": args.seed})
        .env_runners(
            num_env_runners=args.env_runners,
            num_envs_per_env_runner=envs_per_runner,
            num_cpus_per_env_runner=1,
            rollout_fragment_length="auto",
            batch_mode="truncate_episodes",
            sample_timeout_s=600.0,
        )
        .learners(num_learners=0)
        .training(
            train_batch_size_per_learner=args.train_batch_size,
            minibatch_size=args.minibatch_size,
            num_epochs=args.num_epochs,
            gamma=RunConfig().algorithm.gamma,
            lambda_=0.95,
            clip_param=0.2,
            lr=1e-4,
        )
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=hidden, fcnet_activation="tanh", vf_share_layers=False))
        .debugging(seed=args.seed)
    )

    # PPO's training_step calls this module-level function for its sampling phase; timing it gives each iteration's
    # sampling seconds (the result's env_runner_sampling_timer is a moving average over iterations).
    sample_seconds: list[float] = []
    sample = getattr(ppo_module, "synchronous_parallel_sample", None)
    if sample is not None:

        def timed_sample(*sample_args, **sample_kwargs):
            began = time.perf_counter()
            try:
                return sample(*sample_args, **sample_kwargs)
            finally:
                sample_seconds.append(time.perf_counter() - began)

        ppo_module.synchronous_parallel_sample = timed_sample

    steps_key, iteration_key = "env_runners/num_env_steps_sampled_lifetime", "time_this_iter_s"
    timer_key = "timers/env_runner_sampling_timer"
    began = time.perf_counter()
    algo = config.build_algo()
    build_seconds = time.perf_counter() - began
    rows = []
    try:
        previous_steps = 0
        for iteration in range(1, args.iterations + 1):
            calls_before = len(sample_seconds)
            result = algo.train()
            lifetime = int(nested(result, steps_key))
            row = {
                "iteration": iteration,
                "env_steps": lifetime - previous_steps,
                "seconds": float(nested(result, iteration_key)),
                "sample_seconds": sum(sample_seconds[calls_before:]) if sample is not None else None,
            }
            previous_steps = lifetime
            rows.append(row)
            sampled = row["sample_seconds"]
            print(
                f"rllib iteration {iteration}/{args.iterations}{' (warm-up)' if iteration <= args.warmup_iterations else ''}: "
                f"{row['env_steps']} env steps in {row['seconds']:.2f} s"
                + (f" (sampling {sampled:.2f} s)" if sampled is not None else "")
                + f", {row['env_steps'] / row['seconds']:.0f} env steps/s",
                file=sys.stderr,
                flush=True,
            )
        timer_ema = result.get("timers", {}).get(timer_key.split("/")[1])
    finally:
        algo.stop()
        ray.shutdown()
        if sample is not None:
            ppo_module.synchronous_parallel_sample = sample

    timed = rows[args.warmup_iterations :]
    steps, seconds = sum(row["env_steps"] for row in timed), sum(row["seconds"] for row in timed)
    print(f"rllib: env steps from {steps_key!r} (lifetime counter, differences), seconds from {iteration_key!r}", file=sys.stderr)
    results.update(
        {
            "rllib_env_steps_per_second": steps / seconds,
            "rllib_iterations_timed": len(timed),
            "rllib_env_steps_timed": steps,
            "rllib_median_iteration_seconds": statistics.median(row["seconds"] for row in timed),
            "rllib_build_seconds": build_seconds,
            "rllib_env_runners": args.env_runners,
            "rllib_envs_per_env_runner": envs_per_runner,
            "rllib_train_batch_size": args.train_batch_size,
            "rllib_rollout_fragment_length": config.get_rollout_fragment_length(worker_index=1),
            "rllib_minibatch_size": args.minibatch_size,
            "rllib_num_epochs": args.num_epochs,
            "rllib_hidden": args.hidden,
            "rllib_env_steps_key": steps_key,
            "rllib_iteration_seconds_key": iteration_key,
        }
    )
    if sample is not None:
        sampling = sum(row["sample_seconds"] for row in timed)
        results["rllib_sample_env_steps_per_second"] = steps / sampling
        results["rllib_median_sample_seconds"] = statistics.median(row["sample_seconds"] for row in timed)
        # What the rest of the iteration took: the learner's update, weight sync to the runners, metrics.
        results["rllib_outside_sampling_share"] = 1 - sampling / seconds
    if timer_ema is not None:
        results["rllib_result_sampling_timer_ema_seconds"] = float(timer_ema)
    results["rllib_load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
