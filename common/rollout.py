"""Acting with a flow policy in environments: rollout collection and deterministic evaluation.

Ray-free, so the same code runs inside a RolloutActor, in pre-training's final evaluation and in tests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.config import EnvConfig
from common.diagnostics import check_finite_arrays
from common.envs import ChunkedVectorEnv, Layout, MetaworldTaskEnv, execute_chunk
from common.flow import sample_chain
from common.policy import FlowPolicy
from common.trajectory import RolloutBatch


@dataclass
class Decision:
    """One chunk decision for a batch of B observations (numpy, ready to record)."""

    chain: np.ndarray  # (B, K+1, H, A) normalised
    env_actions: np.ndarray  # (B, H, A) de-normalised, clipped to the action bounds
    log_prob: np.ndarray  # (B,)
    log_prob_per_element: np.ndarray  # (B,)
    value: np.ndarray  # (B,)


@torch.no_grad()
def decide(policy: FlowPolicy, obs: np.ndarray, *, deterministic: bool, generator: torch.Generator | None = None) -> Decision:
    """Encode the observations once, sample the denoising chain, and read the critic."""
    check_finite_arrays({"obs": obs}, "environment output")
    device = policy.obs_device
    features = policy.encode(torch.as_tensor(obs, dtype=torch.float32, device=device))
    sample = sample_chain(policy, features, len(obs), deterministic=deterministic, generator=generator, device=device)
    return Decision(
        chain=sample.chain.cpu().numpy(),
        env_actions=policy.to_env_action(sample.chain[:, -1]).cpu().numpy(),
        log_prob=sample.scores.log_prob.cpu().numpy(),
        log_prob_per_element=sample.scores.log_prob_per_element.cpu().numpy(),
        value=policy.value(features).cpu().numpy(),
    )


def make_envs(env_config: EnvConfig, count: int) -> list[MetaworldTaskEnv]:
    return [
        MetaworldTaskEnv(env_config.task, env_config.max_episode_steps, env_config.stop_on_success, env_config.reward) for _ in range(count)
    ]


def collect_rollout(
    policy: FlowPolicy,
    vec_env: ChunkedVectorEnv,
    obs: np.ndarray,
    num_decisions: int,
    generator: torch.Generator,
    weight_version: int,
    actor_index: int,
) -> tuple[RolloutBatch, np.ndarray]:
    """Step every env for `num_decisions` chunk decisions; returns the record and the last observations."""
    start = time.perf_counter()
    per_step: dict[str, list[np.ndarray]] = {name: [] for name in RolloutBatch.PER_DECISION}
    returns, successes, lengths = [], [], []
    env_steps = 0
    for _ in range(num_decisions):
        decision = decide(policy, obs, deterministic=False, generator=generator)
        step = vec_env.step_chunk(decision.env_actions)
        row = {
            "obs": obs, "next_obs": step.next_obs, "chains": decision.chain, "actions": decision.env_actions,
            "rewards": step.reward, "discounts": step.discount, "terminated": step.terminated, "truncated": step.truncated,
            "values": decision.value, "log_probs": decision.log_prob, "log_probs_per_element": decision.log_prob_per_element,
        }  # fmt: skip
        for name, value in row.items():
            per_step[name].append(value)
        returns += step.episode_returns
        successes += step.episode_successes
        lengths += step.episode_lengths
        env_steps += int(step.steps.sum())
        obs = step.obs
    batch = RolloutBatch(
        **{name: np.stack(values) for name, values in per_step.items()},
        episode_returns=np.asarray(returns, dtype=np.float32),
        episode_successes=np.asarray(successes, dtype=bool),
        episode_lengths=np.asarray(lengths, dtype=np.int64),
        weight_version=weight_version,
        actor_index=actor_index,
        sample_seconds=time.perf_counter() - start,
        env_steps=env_steps,
    )
    batch.validate()
    return batch, obs


def evaluate_layouts(policy: FlowPolicy, envs: list[MetaworldTaskEnv], layouts: Sequence[Layout]) -> np.ndarray:
    """One deterministic episode per layout (a_0 = 0, no injected noise); returns success (L,) bool.

    Layouts are run in groups of len(envs), the envs of a group stepped in lock-step, one chunk each.
    """
    successes = np.zeros(len(layouts), dtype=bool)
    for group_start in range(0, len(layouts), len(envs)):
        group = list(layouts[group_start : group_start + len(envs)])
        obs = np.stack([env.reset(options={"layout": layout})[0] for env, layout in zip(envs, group)])
        active = np.ones(len(group), dtype=bool)
        while active.any():
            index = np.flatnonzero(active)
            actions = decide(policy, obs[index], deterministic=True).env_actions
            for i, chunk in zip(index, actions):
                outcome = execute_chunk(envs[i], chunk, gamma=1.0)
                obs[i] = outcome.final_obs
                successes[group_start + i] |= outcome.success
                active[i] = not (outcome.terminated or outcome.truncated)
    return successes


def success_interval(successes: np.ndarray, z: float = 1.96) -> tuple[float, float, float]:
    """Success rate with its Wilson 95% interval: (rate, low, high)."""
    n = len(successes)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p = float(np.mean(successes))
    denom = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    return p, float(centre - half), float(centre + half)
