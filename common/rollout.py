"""Acting with a flow policy in environments: rollout collection and deterministic evaluation.

Ray-free, so the same code runs inside a RolloutActor, in pre-training's final evaluation and in tests.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.config import PolicyConfig, RunConfig
from common.diagnostics import check_finite_arrays
from common.flow import sample_chain
from common.observation import Observation
from common.policy import FlowPolicy
from common.suites import ImageConfig, Layout, Suite, SuiteEnv
from common.trajectory import RolloutBatch
from common.vector_env import ChunkedVectorEnv, execute_chunk


@dataclass
class Decision:
    """One chunk decision for a batch of B observations (numpy, ready to record)."""

    chain: np.ndarray  # (B, K+1, H, A) normalised
    env_actions: np.ndarray  # (B, H, A) de-normalised, clipped to the action bounds
    log_prob: np.ndarray  # (B,)
    log_prob_per_element: np.ndarray  # (B,)
    # (B, C, T, D) the vision tower's tokens of the frames decided on, where the policy sends them (a VLA's
    # actors.speed.send_image_embeddings; FlowPolicy.recorded_image_embeddings); None: the record keeps the frames
    image_embeddings: np.ndarray | None = None


def decision_tensors(
    policy: FlowPolicy, obs: Observation, *, deterministic: bool, generator: torch.Generator | None = None, noise: Tensor | None = None
) -> dict[str, Tensor]:
    """Encode torch observations once and sample the denoising chain: Decision's fields as tensors. No critic: the
    learner values the states itself, with its own weights."""
    features = policy.encode(obs)
    sample = sample_chain(
        policy, features, obs.batch_shape[0], deterministic=deterministic, generator=generator, device=policy.obs_device, noise=noise
    )
    recorded = policy.recorded_image_embeddings(features)
    return {
        "chain": sample.chain,
        "env_actions": policy.to_env_action(sample.chain[:, -1]),
        "log_prob": sample.scores.log_prob,
        "log_prob_per_element": sample.scores.log_prob_per_element,
        **({} if recorded is None else {"image_embeddings": recorded}),
    }


@torch.no_grad()
def decide(policy: FlowPolicy, obs: Observation, *, deterministic: bool, generator: torch.Generator | None = None) -> Decision:
    """One chunk decision for numpy observations: by the policy's CUDA graph when it has one (common.decision_graph),
    else eagerly."""
    check_finite_arrays({"obs": obs.state}, "environment output")
    if policy.decision_graph is not None:
        return Decision(**policy.decision_graph.decide(obs, deterministic=deterministic, generator=generator))
    outputs = decision_tensors(policy, obs.to_torch(policy.obs_device), deterministic=deterministic, generator=generator)
    # .float(): under a bfloat16 autocast some outputs are bfloat16, which numpy cannot hold (a no-op in float32)
    return Decision(**{name: value.float().cpu().numpy() for name, value in outputs.items()})


def camera_configs(policy_config: PolicyConfig) -> list[ImageConfig]:
    """The cameras a policy reads (none for image_size 0), square frames of policy.image_size."""
    if policy_config.image_size == 0:
        return []
    return [ImageConfig(policy_config.image_size, policy_config.image_size, camera) for camera in policy_config.cameras]


class GroupVectorEnv(ChunkedVectorEnv):
    """A ChunkedVectorEnv whose envs form GRPO groups: envs n with the same n // group_size reset to the same
    sequence of layouts, so the k-th episodes of a group's members are rollouts of one initial state (an
    episode is a deterministic function of its layout; only the policy's noise tells them apart).

    Each group draws its layouts from its own generator, seeded by (reset seed, group): the k-th layout of
    a group is the same whenever its members reach their k-th episode, however long their earlier ones ran.
    """

    def __init__(self, envs: list[SuiteEnv], layout_pool: Sequence[Layout], gamma: float, group_size: int) -> None:
        if group_size < 1 or len(envs) % group_size:
            raise ValueError(f"{len(envs)} envs do not split into groups of {group_size}")
        super().__init__(envs, layout_pool, gamma)
        mixed = [group for group in range(0, len(envs), group_size) if len({env.task for env in envs[group : group + group_size]}) > 1]
        if mixed:
            raise ValueError(f"the GRPO group(s) starting at env(s) {mixed} mix tasks: a group's members share their initial states")
        self.group_size = group_size
        self._env_index = {id(env): i for i, env in enumerate(envs)}

    def reset(self, seed: int) -> Observation:
        num_groups = self.num_envs // self.group_size
        self._group_rngs = [np.random.default_rng([seed, group]) for group in range(num_groups)]
        self._group_layouts: list[list[Layout]] = [[] for _ in range(num_groups)]
        self._episodes_started = np.zeros(self.num_envs, dtype=np.int64)
        return super().reset(seed)

    def _reset_env(self, env: SuiteEnv) -> np.ndarray:
        index = self._env_index[id(env)]
        group, episode = index // self.group_size, self._episodes_started[index]
        self._episodes_started[index] += 1
        sequence, pool = self._group_layouts[group], self._task_pools[env.task]
        while len(sequence) <= episode:
            sequence.append(pool[self._group_rngs[group].integers(len(pool))])
        obs, _ = env.reset(options={"layout": sequence[episode]})
        return obs


def make_envs(suite: Suite, tasks: Sequence[str], cameras: Sequence[ImageConfig] = ()) -> list[SuiteEnv]:
    """One env of each of `tasks`, starting from its first training layout (every rollout sets its own layouts before
    it resets)."""
    return [suite.make_env(task, cameras) for task in tasks]


def close_and_free(envs: list | dict) -> None:
    """Close the envs in `envs` (a list, or a dict of them), empty it and free them now. A Metaworld env sits in
    reference cycles (the methods patched onto it hold it), which only a full collection frees: without one, every set
    of envs an actor drops stays in its memory until Python happens to run a collection."""
    while envs:  # popped one by one, so that no name holds the last one during the collection
        (envs.popitem()[1] if isinstance(envs, dict) else envs.pop()).close()
    gc.collect()


def group_tasks(tasks: Sequence[str], num_groups: int, weights: dict[str, float] | None = None) -> list[str]:
    """The task of each of a run's `num_groups` env groups (an env, or a GRPO group), all actors' in order. Each task
    gets one group, and the rest in proportion to its weight (`weights`, 1.0 where not named; by largest remainder,
    ties to the earlier task); the tasks are interleaved (smooth weighted round robin), so every actor's envs mix them.
    Equal weights deal the tasks in turn: every task samples equally when the groups are a multiple of the tasks."""
    if num_groups < len(tasks):
        raise ValueError(f"{num_groups} env groups cannot sample {len(tasks)} tasks: at least one each")
    weight = np.array([(weights or {}).get(task, 1.0) for task in tasks], dtype=float)
    quotas = (num_groups - len(tasks)) * weight / weight.sum()
    counts = 1 + np.floor(quotas).astype(np.int64)
    counts[np.argsort(-(quotas - np.floor(quotas)), kind="stable")[: num_groups - counts.sum()]] += 1
    credit, order = np.zeros(len(tasks), dtype=np.int64), []
    for _ in range(num_groups):
        credit += counts
        chosen = int(np.argmax(credit))  # the first of the largest
        credit[chosen] -= num_groups
        order.append(tasks[chosen])
    return order


def run_group_tasks(config: RunConfig, tasks: Sequence[str]) -> tuple[list[str], int]:
    """group_tasks for a run: its env groups' tasks under env.task_weights, and the envs of a group (a GRPO group's
    size, else 1)."""
    group = config.algorithm.group_size if config.algorithm.algo == "grpo" else 1
    return group_tasks(tasks, config.actors.num_actors * config.actors.envs_per_actor // group, config.env.task_weights), group


def env_tasks(groups: Sequence[str], actor_index: int, envs_per_actor: int, group_size: int = 1) -> list[str]:
    """The task of each env of one rollout actor, from the run's group_tasks: the run's envs (all actors', in order)
    take the groups' tasks, `group_size` envs (a GRPO group) at a time; an actor past the run's count (a tool's own)
    starts over from the first group."""
    first = actor_index * envs_per_actor
    return [groups[((first + env) // group_size) % len(groups)] for env in range(envs_per_actor)]


def task_positions(layouts: Sequence[Layout]) -> dict[str, list[int]]:
    """The positions of each task's layouts in `layouts`, tasks in order of first appearance."""
    positions: dict[str, list[int]] = {}
    for position, layout in enumerate(layouts):
        positions.setdefault(layout.task, []).append(position)
    return positions


def episode_groups(layouts: Sequence[Layout], num_envs: int) -> int:
    """How many groups of episodes an actor runs held-out `layouts` in (evaluate_layouts, task by task, `num_envs` at a
    time): the units of work of one evaluate() call."""
    return sum(-(-len(positions) // num_envs) for positions in task_positions(layouts).values())


def instruction_tokens(policy: FlowPolicy, envs: Sequence[SuiteEnv]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Each env's instruction tokenized by the policy, once per env (it never changes): ids (N, L) int64
    and mask (N, L) bool, or (None, None) for a policy that reads no language."""
    tokens = policy.tokenize([env.instruction for env in envs])
    return (None, None) if tokens is None else tokens


def collect_rollout(
    policy: FlowPolicy,
    vec_env: ChunkedVectorEnv,
    obs: np.ndarray,
    num_decisions: int,
    generator: torch.Generator,
    weight_version: int,
    actor_index: int,
) -> tuple[RolloutBatch, np.ndarray]:
    """Step every env for `num_decisions` chunk decisions; returns the record and the last observations.

    The record carries frames (obs.images) when the envs have cameras, or where the policy sends them the vision
    tower's tokens of the frames in their place (obs.image_embeddings), and the instruction's tokens when the policy
    reads language; each env's instruction is tokenized once, here, not per decision. An observation a chunk led to is
    recorded only where the next decision does not read it (RolloutBatch.bootstrap_obs), with its frames."""
    start = time.perf_counter()
    token_ids, token_mask = instruction_tokens(policy, vec_env.envs)
    per_step: dict[str, list[np.ndarray]] = {}
    observations: list[Observation] = []
    bootstrap_at: list[np.ndarray] = []
    bootstrap_obs: list[Observation] = []
    returns, successes, lengths, tasks, firsts = [], [], [], [], []
    env_steps = 0
    valid = np.ones((num_decisions, vec_env.num_envs), dtype=bool)
    episode_start = np.zeros(vec_env.num_envs, dtype=np.int64)  # first decision of each env's current episode
    policy_cpu = env_cpu = 0.0
    for t in range(num_decisions):
        obs = dataclasses.replace(obs, tokens=token_ids, token_mask=token_mask)
        decided = time.thread_time()
        decision = decide(policy, obs, deterministic=False, generator=generator)
        stepped = time.thread_time()
        step = vec_env.step_chunk(decision.env_actions)
        policy_cpu, env_cpu = policy_cpu + stepped - decided, env_cpu + time.thread_time() - stepped
        row = {
            "chains": decision.chain,
            "rewards": step.reward,
            "discounts": step.discount,
            "terminated": step.terminated,
            "truncated": step.truncated,
            "log_probs": decision.log_prob,
            "log_probs_per_element": decision.log_prob_per_element,
        }
        for name, value in row.items():
            per_step.setdefault(name, []).append(value)
        observations.append(
            obs if decision.image_embeddings is None else dataclasses.replace(obs, images=None, image_embeddings=decision.image_embeddings)
        )
        ended = np.flatnonzero(step.terminated | step.truncated) if t < num_decisions - 1 else np.arange(vec_env.num_envs)
        bootstrap_at.append(np.stack([np.full(len(ended), t), ended], axis=1))
        bootstrap_obs.append(step.next_obs.index(ended))
        for n in np.flatnonzero(step.nonfinite):  # the env broke: drop every decision of that episode
            valid[episode_start[n] : t + 1, n] = False
        counted = np.flatnonzero((step.terminated | step.truncated) & ~step.nonfinite)  # step.episode_*'s envs, in order
        firsts += list(episode_start[counted] == 0)
        episode_start[step.terminated | step.truncated] = t + 1
        returns += step.episode_returns
        successes += step.episode_successes
        lengths += step.episode_lengths
        tasks += step.episode_tasks
        env_steps += int(step.steps.sum())
        obs = step.obs
    batch = RolloutBatch(
        obs=Observation.stack(observations),
        **{name: np.stack(values) for name, values in per_step.items()},
        valid=valid,
        bootstrap_at=np.concatenate(bootstrap_at).astype(np.int64),
        bootstrap_obs=Observation.concat(bootstrap_obs),
        episode_returns=np.asarray(returns, dtype=np.float32),
        episode_successes=np.asarray(successes, dtype=bool),
        episode_lengths=np.asarray(lengths, dtype=np.int64),
        episode_first=np.asarray(firsts, dtype=bool),
        episode_tasks=tuple(tasks),
        env_tasks=tuple(env.task for env in vec_env.envs),
        weight_version=weight_version,
        actor_index=actor_index,
        sample_seconds=time.perf_counter() - start,
        env_steps=env_steps,
        actor_precision=policy.precision,
        policy_cpu_seconds=policy_cpu,
        env_cpu_seconds=env_cpu,
    )
    return batch, obs


def evaluate_layouts(
    policy: FlowPolicy, envs: list[SuiteEnv], layouts: Sequence[Layout], noise: torch.Generator | None = None
) -> np.ndarray:
    """One episode per layout; returns success (L,) bool. Deterministic (no injected noise; a_0 = 0, or drawn from
    N(0, policy.eval_init_noise_std^2) by a generator seeded by each group's first layout) unless `noise` is given: then
    each chunk is sampled as the rollouts sample it, the noise drawn from that generator.

    Layouts are run in groups of len(envs), the envs of a group stepped in lock-step, one chunk each.
    Frames (when the envs have cameras) are rendered once per chunk, the instruction tokenized once per env.
    """
    successes = np.zeros(len(layouts), dtype=bool)
    token_ids, token_mask = instruction_tokens(policy, envs)
    for group_start in range(0, len(layouts), len(envs)):
        group = list(layouts[group_start : group_start + len(envs)])
        group_envs = envs[: len(group)]
        states = np.stack([env.reset(options={"layout": layout})[0] for env, layout in zip(group_envs, group)])
        frames = np.stack([env.render_cameras() for env in group_envs]) if envs[0].num_cameras else None
        obs = Observation(states, frames, *(None if ids is None else ids[: len(group)] for ids in (token_ids, token_mask)))
        active = np.ones(len(group), dtype=bool)
        starts = None
        if noise is None and policy.config.eval_init_noise_std > 0:
            starts = torch.Generator(policy.obs_device).manual_seed(group[0].benchmark_seed * 1_000_003 + group[0].index)
        while active.any():
            index = np.flatnonzero(active)
            generator = noise if noise is not None else starts
            actions = decide(policy, obs.index(index), deterministic=noise is None, generator=generator).env_actions
            for i, chunk in zip(index, actions):
                outcome = execute_chunk(envs[i], chunk, gamma=1.0)
                obs.state[i] = outcome.final_obs
                if obs.images is not None:
                    obs.images[i] = envs[i].render_cameras()
                successes[group_start + i] |= outcome.success
                active[i] = not (outcome.terminated or outcome.truncated)
    return successes
