"""The typed rollout record actors send to the learner, and the versioned weights sent back.

Both are plain numpy so they travel through Ray's object store without pickling torch tensors
(numpy arrays come back as zero-copy, READ-ONLY views of shared memory: never write into them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from common.diagnostics import check_finite_arrays
from common.observation import Observation


@dataclass
class RolloutBatch:
    """T chunk decisions in each of N envs, all sampled with one weight version: what the learner reads, once each.
    Shapes below (M: the bootstrap rows)."""

    # (T, N, ...) what each chunk was chosen on: state, and frames (or the vision tower's tokens of them, where the actor
    # sends those: actors.speed.send_image_embeddings) and instruction tokens when the policy reads them; compact on
    # purpose: frames stay uint8 and the instruction travels as token ids
    obs: Observation
    chains: np.ndarray  # (T, N, K+1, H, A) float32 the whole denoising chain, normalised units
    rewards: np.ndarray  # (T, N) float32            sum_i gamma^i r_i over the chunk's executed steps
    discounts: np.ndarray  # (T, N) float32          gamma ** executed steps
    terminated: np.ndarray  # (T, N) bool
    truncated: np.ndarray  # (T, N) bool
    log_probs: np.ndarray  # (T, N) float32          behaviour chain log-prob (policy's normalisation)
    log_probs_per_element: np.ndarray  # (T, N) float32
    # (T, N) bool: False on every decision of an episode that an env ended with NaN/Inf output (its samples are
    # dropped by the learner, and the episode is left out of the episode statistics)
    valid: np.ndarray
    # The observations a chunk led to where they are not the next decision's of its env: its episode ended (the final
    # observation, before the reset), or it was the rollout's last decision. (M, 2) int64 (decision, env), in that
    # order, and (M, ...) state and frames (frames also where `obs` carries tokens in their place: no decision read
    # these); the instruction is the env's, in `obs`.
    bootstrap_at: np.ndarray
    bootstrap_obs: Observation
    episode_returns: np.ndarray  # (E,) float32      episodes that ended during this rollout
    episode_successes: np.ndarray  # (E,) bool
    episode_lengths: np.ndarray  # (E,) int64
    # (E,) bool: the episode is the first its env ran in this rollout (started at the rollout's reset). Success over
    # these alone is the sampling policy's success rate on the training layouts; over every episode that ended, quick
    # successes count several times per env and failures, which run to the episode limit, once.
    episode_first: np.ndarray
    weight_version: int
    actor_index: int
    sample_seconds: float
    env_steps: int
    actor_precision: str = ""  # the behaviour policy's parameter dtype(s) and device, e.g. "bfloat16 on cuda:0"
    # CPU seconds of the sampling thread in the policy (chunk decisions) and in the envs (stepping them): where an
    # actor's work goes, whatever the machine's load. Summed over the actors by concat.
    policy_cpu_seconds: float = 0.0
    env_cpu_seconds: float = 0.0
    # (E,) the task of each episode in episode_returns/successes/lengths: per-task rollout statistics of a multi-task
    # run. Names, not an array: a record of what ran, not a quantity the update reads.
    episode_tasks: tuple[str, ...] = ()
    # (N,) the task of each env: what a multi-task update groups decisions by (algorithm.normalize_advantages_per_task).
    env_tasks: tuple[str, ...] = ()

    PER_DECISION = ("chains", "rewards", "discounts", "terminated", "truncated", "log_probs", "log_probs_per_element", "valid")

    @property
    def num_decisions(self) -> int:
        return self.obs.batch_shape[0]

    @property
    def num_envs(self) -> int:
        return self.obs.batch_shape[1]

    def bootstrap_rows(self) -> np.ndarray:
        """(M,) the bootstrap observations' rows in the flattened (B = T * N) order of the decisions."""
        return self.bootstrap_at[:, 0] * self.num_envs + self.bootstrap_at[:, 1]

    def bootstrap_observations(self) -> Observation:
        """(M, ...) the bootstrap observations, with their envs' instruction tokens when the policy reads language."""
        rows = self.bootstrap_rows()
        tokens = {
            name: array.reshape(-1, array.shape[-1])[rows] for name, array in self.obs.present().items() if name in ("tokens", "token_mask")
        }
        return Observation(**self.bootstrap_obs.present(), **tokens)

    def validate(self) -> None:
        """Shapes and dtypes agree, the bootstrap rows are those the learner needs, and every float is finite; raises
        ValueError, or NonFiniteError naming the field (Learner.update rolls such an iteration back)."""
        where = f"rollout from actor {self.actor_index}" if self.actor_index >= 0 else "rollouts"
        try:
            self.obs.validate(), self.bootstrap_obs.validate()  # dtypes: uint8 frames, int64 tokens, bool mask
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        leading = self.obs.batch_shape
        if len(leading) != 2:
            raise ValueError(f"{where}: RolloutBatch.obs must be (decisions, envs, ...), got leading dims {leading}")
        for name in self.PER_DECISION:
            if getattr(self, name).shape[:2] != leading:
                raise ValueError(f"{where}: RolloutBatch.{name} has shape {getattr(self, name).shape}, expected leading dims {leading}")
        needed = np.zeros(leading, dtype=bool)
        needed[-1] = True
        needed |= self.terminated | self.truncated
        at = self.bootstrap_at
        if at.dtype != np.int64 or at.ndim != 2 or at.shape[1] != 2 or not (at >= 0).all() or not (at < leading).all():
            raise ValueError(f"{where}: RolloutBatch.bootstrap_at must be (M, 2) int64 (decision, env) pairs within {leading}")
        if not np.array_equal(self.bootstrap_rows(), np.flatnonzero(needed)):
            raise ValueError(
                f"{where}: RolloutBatch.bootstrap_at must name, in order, every decision whose episode ended and "
                "every env's last decision, and no other"
            )
        seen = {"images", "image_embeddings"} & set(self.obs.present())
        fields, want = sorted(self.bootstrap_obs.present()), ["images", "state"] if seen else ["state"]
        if self.bootstrap_obs.batch_shape != (len(at),) or fields != want:
            raise ValueError(
                f"{where}: RolloutBatch.bootstrap_obs must hold {want} of the {len(at)} bootstrap rows, got "
                f"{self.bootstrap_obs.batch_shape} rows of {fields}"
            )
        if self.env_tasks and len(self.env_tasks) != self.num_envs:
            raise ValueError(f"{where}: RolloutBatch.env_tasks names {len(self.env_tasks)} envs, expected {self.num_envs}")
        if len(self.episode_first) != len(self.episode_successes):
            raise ValueError(
                f"{where}: RolloutBatch.episode_first flags {len(self.episode_first)} episodes, expected {len(self.episode_successes)}"
            )
        if self.episode_tasks and len(self.episode_tasks) != len(self.episode_successes):
            raise ValueError(
                f"{where}: RolloutBatch.episode_tasks names {len(self.episode_tasks)} episodes, expected {len(self.episode_successes)}"
            )
        floats = {name: getattr(self, name) for name in self.PER_DECISION}
        if self.obs.image_embeddings is not None:
            floats["obs.image_embeddings"] = self.obs.image_embeddings
        check_finite_arrays({"obs": self.obs.state, "bootstrap_obs": self.bootstrap_obs.state, **floats}, where)

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Join batches of the same length along the env axis (actor order is kept)."""
        if len({b.num_decisions for b in batches}) != 1:
            raise ValueError(f"rollouts have different lengths {[b.num_decisions for b in batches]}")
        fields = {tuple(b.obs.present()) for b in batches}
        if len(fields) != 1:
            raise ValueError(f"rollouts carry different observation fields {sorted(fields)}: actors built with different policy configs?")
        per_decision = {n: np.concatenate([getattr(b, n) for b in batches], axis=1) for n in RolloutBatch.PER_DECISION}
        per_episode = {
            n: np.concatenate([getattr(b, n) for b in batches])
            for n in ("episode_returns", "episode_successes", "episode_lengths", "episode_first")
        }
        offsets = np.cumsum([0] + [b.num_envs for b in batches[:-1]])
        at = np.concatenate([b.bootstrap_at + [0, offset] for b, offset in zip(batches, offsets, strict=True)])
        order = np.lexsort((at[:, 1], at[:, 0]))  # by decision, then env: the flattened order
        return RolloutBatch(
            obs=Observation.concat([b.obs for b in batches], axis=1),
            **per_decision,
            bootstrap_at=at[order],
            bootstrap_obs=Observation.concat([b.bootstrap_obs for b in batches]).index(order),
            **per_episode,
            weight_version=min(b.weight_version for b in batches),
            actor_index=-1,
            sample_seconds=max(b.sample_seconds for b in batches),
            env_steps=sum(b.env_steps for b in batches),
            actor_precision=", ".join(sorted({b.actor_precision for b in batches})),
            policy_cpu_seconds=sum(b.policy_cpu_seconds for b in batches),
            env_cpu_seconds=sum(b.env_cpu_seconds for b in batches),
            episode_tasks=sum((b.episode_tasks for b in batches), ()),
            env_tasks=sum((b.env_tasks for b in batches), ()),
        )

    def statistics_only(self) -> RolloutBatch:
        """The record without its chains and frames (views, no copies): what the rollout statistics read, for a learner
        rank to send to the rank that reports them."""
        return dataclasses.replace(
            self,
            obs=Observation(state=self.obs.state),
            chains=self.chains[:, :, :0],
            bootstrap_obs=Observation(state=self.bootstrap_obs.state),
        )

    def tensors(self, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Copies as torch tensors (copies, because the arrays may be read-only shared memory)."""
        return {n: torch.from_numpy(np.array(getattr(self, n))) for n in names}


@dataclass(frozen=True)
class WeightsPayload:
    """One published weight version: the parameters actors need, as numpy arrays."""

    version: int
    params: dict[str, np.ndarray]

    @staticmethod
    def from_state(version: int, state: dict[str, torch.Tensor], copy: bool = True) -> WeightsPayload:
        """copy=False: arrays that view the CPU tensors' memory (a GPU tensor is copied to the CPU either way), for a
        payload serialised at once: ray.put copies it into the object store before it returns, so the later
        updates of the tensors never reach it. A payload kept in Python needs copy=True."""
        arrays = {k: v.detach().cpu().numpy() for k, v in state.items()}
        return WeightsPayload(version, {k: a.copy() for k, a in arrays.items()} if copy else arrays)
