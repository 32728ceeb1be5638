"""The CPU cost of one env step: the project's Metaworld env against Metaworld's own reset and contact check.

    python bench/env_step.py                      # pick-place, 10 envs, 5 CPU-seconds per case
    python bench/env_step.py --seconds 0.5 --envs 2   # a smoke run

Two kinds of actions, each stepped through `common.vector_env.ChunkedVectorEnv` (chunks of the default policy's size,
episodes reset as in training, training layouts) by one process, in one thread:
  - random: uniform chunks, what bench/throughput.py's env limit steps. The arm flails and rarely touches the block,
    and every episode runs to its 200-step limit;
  - expert: the scripted expert's actions with Gaussian noise (std --expert-noise), the kind of episode a trained
    policy produces: the gripper closes on the block, and successful episodes end (and reset) early.
For each kind, `metaworld` builds the envs with metaworld_shortcuts=False (Metaworld's own reset, with its first
reset_model() call, and its per-contact Python loop in touching_object) and `project` with the shortcuts, which give
the same observations, rewards and infos bit for bit (tests/integration/test_envs.py). The cases take turns, --rounds times, after
an untimed warm-up; each figure is the median of its rounds. `<kind>_<variant>_us_per_step` is CPU microseconds
(thread time) per env step, resets included; `<kind>_project_over_metaworld` < 1 means the project's is cheaper; and
`expert_over_random_<variant>` is how much more a step of real manipulation costs than a random one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.report import emit, load_average
from common.config import RunConfig
from common.suites.metaworld import Layout, MetaworldSuite, MetaworldTaskEnv, ScriptedExpert
from common.vector_env import ChunkedVectorEnv

VARIANTS = {"metaworld": False, "project": True}


class Case:
    """One (action kind, env variant): its envs, stepped for a given CPU time per round."""

    def __init__(self, kind: str, shortcuts: bool, num_envs: int, expert_noise: float, seed: int) -> None:
        config = RunConfig()
        self.kind, self.chunk_size, self.expert_noise = kind, config.policy.chunk_size, expert_noise
        first = Layout(config.env.task, config.env.train_benchmark_seeds[0], 0)
        envs = [MetaworldTaskEnv(config.env.task, config.env.max_episode_steps, config.env.stop_on_success, layout=first,
                                 metaworld_shortcuts=shortcuts) for _ in range(num_envs)]  # fmt: skip
        self.vec_env = ChunkedVectorEnv(
            envs, MetaworldSuite(config.env).layouts(config.env.task, config.env.train_benchmark_seeds), config.algorithm.gamma
        )
        self.expert = ScriptedExpert(config.env.task)
        self.rng = np.random.default_rng(seed)
        self.state = self.vec_env.reset(seed).state

    def chunk(self) -> np.ndarray:
        """(N, H, A) actions: random, or the expert's for the current states (held for the chunk) with noise."""
        shape = (self.vec_env.num_envs, self.chunk_size, self.vec_env.single_action_space.shape[0])
        if self.kind == "random":
            return self.rng.uniform(-1.0, 1.0, shape).astype(np.float32)
        expert = np.stack([self.expert.act(state) for state in self.state])[:, None, :]
        return np.clip(expert + self.rng.normal(0.0, self.expert_noise, shape), -1.0, 1.0).astype(np.float32)

    def run(self, cpu_seconds: float) -> float:
        """Microseconds of env CPU per env step over about `cpu_seconds` (the expert's own time is left out)."""
        env_cpu, steps = 0.0, 0
        while env_cpu < cpu_seconds:
            actions = self.chunk()
            began = time.thread_time()
            step = self.vec_env.step_chunk(actions)
            env_cpu += time.thread_time() - began
            steps += int(step.steps.sum())
            self.state = step.obs.state
        return env_cpu / steps * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=10, help="envs per ChunkedVectorEnv")
    parser.add_argument("--seconds", type=float, default=5.0, help="env CPU seconds per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (the cases take turns)")
    parser.add_argument("--expert-noise", type=float, default=0.3, help="std of the noise on the expert's actions")
    args = parser.parse_args(argv)
    if args.envs < 1 or args.seconds <= 0 or args.rounds < 1:
        raise SystemExit("--envs and --rounds must be >= 1 and --seconds > 0")
    cases = {(kind, variant): Case(kind, shortcuts, args.envs, args.expert_noise, seed=0)
             for kind in ("random", "expert") for variant, shortcuts in VARIANTS.items()}  # fmt: skip
    results: dict = {"bench": "env_step", "envs": args.envs, "load_average_1m_start": load_average()}
    for case in cases.values():
        case.run(min(args.seconds, 1.0))  # untimed warm-up
    rounds: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, case in cases.items():
            rounds[key].append(case.run(args.seconds))
    for (kind, variant), values in rounds.items():
        results[f"{kind}_{variant}_us_per_step"] = statistics.median(values)
    for kind in ("random", "expert"):
        results[f"{kind}_project_over_metaworld"] = results[f"{kind}_project_us_per_step"] / results[f"{kind}_metaworld_us_per_step"]
    for variant in VARIANTS:
        results[f"expert_over_random_{variant}"] = results[f"expert_{variant}_us_per_step"] / results[f"random_{variant}_us_per_step"]
    results["load_average_1m_end"] = load_average()
    emit(results)
    return results


if __name__ == "__main__":
    main()
