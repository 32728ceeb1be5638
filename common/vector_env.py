"""Stepping N suite envs a whole action chunk at a time, in one process.

Works on any SuiteEnv (common.suites.base): the state vector, info["success"], cameras rendered on demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gymnasium import spaces

from common.observation import Observation
from common.suites.base import Layout, SuiteEnv


@dataclass
class ChunkStep:
    """Result of executing one action chunk in every env of a `ChunkedVectorEnv`."""

    next_obs: Observation  # (N, ...) after the chunk; the final one if the episode ended (state, and frames with cameras).
    obs: Observation  # (N, ...) for the next chunk; the reset one if the episode ended.
    reward: np.ndarray  # (N,) float32, sum_i gamma**i * r_i over the executed steps (shaped with env.reward "shaped").
    discount: np.ndarray  # (N,) float32, gamma**steps: the factor for the value of next_obs.
    steps: np.ndarray  # (N,) int, env steps executed (< H when the episode ended mid-chunk).
    terminated: np.ndarray  # (N,) bool
    truncated: np.ndarray  # (N,) bool
    success: np.ndarray  # (N,) bool, success was reported at some step of this chunk.
    nonfinite: np.ndarray  # (N,) bool, the env returned NaN/Inf: the episode was ended (truncated) and is left out of the stats.
    episode_returns: list[float]  # Undiscounted returns of the episodes that ended in this chunk.
    episode_successes: list[bool]
    episode_lengths: list[int]
    episode_tasks: list[str]  # the task each of those episodes ran


@dataclass
class ChunkOutcome:
    """What executing one action chunk in one env produced."""

    final_obs: np.ndarray  # Observation after the last executed step.
    discounted_reward: float  # sum_i gamma**i * r_i
    reward_sum: float  # Undiscounted, for episode returns.
    steps: int  # Steps executed, < H when the episode ended mid-chunk.
    terminated: bool
    truncated: bool
    success: bool
    nonfinite: bool = False  # the env returned NaN/Inf (observation or reward): the episode was ended there
    potential: float | None = None  # env.reward "shaped": the potential the episode's next step starts from


def execute_chunk(env: SuiteEnv, actions: np.ndarray, gamma: float, potential: float | None = None) -> ChunkOutcome:
    """Steps `env` through `actions` (H, A), stopping at the end of the episode; does not reset.

    An env that reports `info["shaping_potential"]` (env.reward "shaped") has its rewards shaped, r + gamma * phi' - phi
    (potential-based shaping: an episode's discounted sum of it is gamma**T * phi_T less the start's potential, so it
    pays progress toward success without changing which policy is best). The potential ends at 0 when the episode terminates, so
    success is not paid twice, and carries over a truncation, whose value the critic bootstraps. `potential` is the
    one left by the episode's previous chunk, None at its start: its first step then pays no shaping. Undiscounted
    returns (reward_sum) stay the env's own."""
    if len(actions) == 0:
        raise ValueError("actions must hold at least one step")
    discounted_reward = reward_sum = 0.0
    success = terminated = truncated = False
    for i, action in enumerate(actions):
        obs, reward, terminated, truncated, info = env.step(action)
        next_potential = info.get("shaping_potential")
        if not (np.isfinite(obs).all() and np.isfinite(reward) and np.isfinite(next_potential or 0.0)):  # a broken simulation: end it here
            final_obs = np.where(np.isfinite(obs), obs, 0.0).astype(obs.dtype)  # finite; its decisions are dropped anyway
            return ChunkOutcome(final_obs, discounted_reward, reward_sum, i + 1, False, True, success, nonfinite=True)
        reward_sum += reward
        if next_potential is not None:
            start = gamma * next_potential if potential is None else potential
            potential = 0.0 if terminated else next_potential
            reward = reward + gamma * potential - start
        discounted_reward += gamma**i * reward
        success |= info["success"]
        if terminated or truncated:
            break
    return ChunkOutcome(obs, discounted_reward, reward_sum, i + 1, terminated, truncated, success, potential=potential)


class ChunkedVectorEnv:
    """N SuiteEnvs stepped in one process, a whole action chunk at a time.

    An env whose episode ends mid-chunk stops executing the rest of that chunk (the remaining
    actions belong to no episode) and is reset at once (same-step autoreset at chunk level), so no
    transition ever mixes two episodes and nothing needs masking. Every reset draws the env's
    layout uniformly from the layouts of its task in `layout_pool`, with the generator seeded in `reset(seed)`.

    Observations are `Observation` records: the (N, obs_dim) state and, when the envs were built with
    `cameras`, the (N, C, H, W, 3) uint8 frames, rendered once per chunk (after it, and after a reset).
    """

    def __init__(self, envs: list[SuiteEnv], layout_pool: Sequence[Layout], gamma: float) -> None:
        if not envs:
            raise ValueError("envs must not be empty")
        if not layout_pool:
            raise ValueError("layout_pool must not be empty")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if not all(isinstance(env.observation_space, spaces.Box) for env in envs):
            raise ValueError(
                "ChunkedVectorEnv steps envs that observe a state vector and renders their cameras once per chunk: build them "
                "with cameras=[ImageConfig(...)], not an image observation"
            )
        if len({env.num_cameras for env in envs}) != 1:
            raise ValueError(f"every env needs the same cameras, got camera counts {[env.num_cameras for env in envs]}")
        self.envs = envs
        self.num_envs = len(envs)
        self.single_observation_space = envs[0].observation_space
        self.single_action_space = envs[0].action_space
        self._task_pools = {env.task: [layout for layout in layout_pool if layout.task == env.task] for env in envs}
        empty = [task for task, pool in self._task_pools.items() if not pool]
        if empty:
            raise ValueError(f"layout_pool holds no layout of the envs' task(s) {empty}")
        self._gamma = gamma
        self._rng: np.random.Generator | None = None
        self._episode_returns = np.zeros(self.num_envs)
        self._episode_lengths = np.zeros(self.num_envs, dtype=np.int64)
        self._episode_successes = np.zeros(self.num_envs, dtype=bool)
        self._potentials: list[float | None] = [None] * self.num_envs  # where each episode's shaping stands (execute_chunk)

    def reset(self, seed: int) -> Observation:
        """Starts a fresh episode in every env; returns the N observations."""
        self._rng = np.random.default_rng(seed)
        self._episode_returns[:] = 0.0
        self._episode_lengths[:] = 0
        self._episode_successes[:] = False
        self._potentials = [None] * self.num_envs
        states = np.stack([self._reset_env(env) for env in self.envs])
        return Observation(states, self._frames())

    def step_chunk(self, actions: np.ndarray) -> ChunkStep:
        """Executes `actions` (N, H, A) and auto-resets the envs whose episode ended."""
        if self._rng is None:
            raise RuntimeError("call reset(seed) before step_chunk()")
        expected = (self.num_envs, self.single_action_space.shape[0])
        if actions.ndim != 3 or actions.shape[1] == 0 or (actions.shape[0], actions.shape[2]) != expected:
            raise ValueError(f"actions must have shape (N={expected[0]}, H>=1, A={expected[1]}), got {actions.shape}")

        outcomes = [
            execute_chunk(env, env_actions, self._gamma, potential)
            for env, env_actions, potential in zip(self.envs, actions, self._potentials, strict=True)
        ]
        next_obs = Observation(np.stack([outcome.final_obs for outcome in outcomes]), self._frames())  # before any reset
        obs = Observation(**{name: array.copy() for name, array in next_obs.present().items()})
        episode_returns: list[float] = []
        episode_successes: list[bool] = []
        episode_lengths: list[int] = []
        episode_tasks: list[str] = []
        for i, outcome in enumerate(outcomes):
            self._episode_returns[i] += outcome.reward_sum
            self._episode_lengths[i] += outcome.steps
            self._episode_successes[i] |= outcome.success
            self._potentials[i] = outcome.potential
            if outcome.terminated or outcome.truncated:
                if not outcome.nonfinite:
                    episode_returns.append(float(self._episode_returns[i]))
                    episode_successes.append(bool(self._episode_successes[i]))
                    episode_lengths.append(int(self._episode_lengths[i]))
                    episode_tasks.append(self.envs[i].task)
                self._episode_returns[i], self._episode_lengths[i], self._episode_successes[i] = 0.0, 0, False
                self._potentials[i] = None
                obs.state[i] = self._reset_env(self.envs[i])
                if obs.images is not None:
                    obs.images[i] = self.envs[i].render_cameras()

        steps = np.array([outcome.steps for outcome in outcomes], dtype=np.int64)
        return ChunkStep(
            next_obs=next_obs,
            obs=obs,
            reward=np.array([outcome.discounted_reward for outcome in outcomes], dtype=np.float32),
            discount=np.array([self._gamma**n for n in steps], dtype=np.float32),
            steps=steps,
            terminated=np.array([outcome.terminated for outcome in outcomes]),
            truncated=np.array([outcome.truncated for outcome in outcomes]),
            success=np.array([outcome.success for outcome in outcomes]),
            nonfinite=np.array([outcome.nonfinite for outcome in outcomes]),
            episode_returns=episode_returns,
            episode_successes=episode_successes,
            episode_lengths=episode_lengths,
            episode_tasks=episode_tasks,
        )

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def _frames(self) -> np.ndarray | None:
        """(N, C, H, W, 3) uint8 frames of the current scenes, or None when the envs have no cameras."""
        return np.stack([env.render_cameras() for env in self.envs]) if self.envs[0].num_cameras else None

    def _reset_env(self, env: SuiteEnv) -> np.ndarray:
        pool = self._task_pools[env.task]
        obs, _ = env.reset(options={"layout": pool[self._rng.integers(len(pool))]})
        return obs
