"""The typed rollout record actors send to the learner, and the versioned weights sent back.

Both are plain numpy so they travel through Ray's object store without pickling torch tensors
(numpy arrays come back as zero-copy, READ-ONLY views of shared memory: never write into them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.diagnostics import check_finite_arrays
from common.observation import Observation


@dataclass
class RolloutBatch:
    """T chunk decisions in each of N envs, all sampled with one weight version. Shapes below."""

    obs: np.ndarray  # (T, N, obs_dim) float32   state the chunk was chosen in
    next_obs: np.ndarray  # (T, N, obs_dim) float32   state after the chunk (final state if the episode ended)
    chains: np.ndarray  # (T, N, K+1, H, A) float32 the whole denoising chain, normalised units
    actions: np.ndarray  # (T, N, H, A) float32      executed env actions (de-normalised, clipped)
    rewards: np.ndarray  # (T, N) float32            sum_i gamma^i r_i over the chunk's executed steps
    discounts: np.ndarray  # (T, N) float32          gamma ** executed steps
    terminated: np.ndarray  # (T, N) bool
    truncated: np.ndarray  # (T, N) bool
    values: np.ndarray  # (T, N) float32             behaviour critic V(obs)
    log_probs: np.ndarray  # (T, N) float32          behaviour chain log-prob (policy's normalisation)
    log_probs_per_element: np.ndarray  # (T, N) float32
    # (T, N) bool: False on every decision of an episode that an env ended with NaN/Inf output (its samples are
    # dropped by the learner, and the episode is left out of the episode statistics)
    valid: np.ndarray
    episode_returns: np.ndarray  # (E,) float32      episodes that ended during this rollout
    episode_successes: np.ndarray  # (E,) bool
    episode_lengths: np.ndarray  # (E,) int64
    weight_version: int
    actor_index: int
    sample_seconds: float
    env_steps: int
    # Per decision like the arrays above, present only when the policy reads them (None otherwise);
    # compact on purpose: frames stay uint8 and the instruction travels as token ids.
    images: np.ndarray | None = None  # (T, N, C, H, W, 3) uint8  camera frames the chunk was chosen on
    next_images: np.ndarray | None = None  # (T, N, C, H, W, 3) uint8  frames after the chunk (as next_obs)
    tokens: np.ndarray | None = None  # (T, N, L) int64           the env's instruction as token ids
    token_mask: np.ndarray | None = None  # (T, N, L) bool        True on real tokens
    actor_precision: str = ""  # the behaviour policy's parameter dtype(s) and device, e.g. "bfloat16 on cuda:0"
    # CPU seconds of the sampling thread in the policy (chunk decisions) and in the envs (stepping them): where an
    # actor's work goes, whatever the machine's load. Summed over the actors by concat.
    policy_cpu_seconds: float = 0.0
    env_cpu_seconds: float = 0.0
    # (E,) the task of each episode in episode_returns/successes/lengths: per-task rollout statistics of a multi-task
    # run. Names, not an array: a record of what ran, not a quantity the update reads.
    episode_tasks: tuple[str, ...] = ()

    PER_DECISION = ("obs", "next_obs", "chains", "actions", "rewards", "discounts", "terminated", "truncated",
                    "values", "log_probs", "log_probs_per_element", "valid")  # fmt: skip
    OPTIONAL_PER_DECISION = ("images", "next_images", "tokens", "token_mask")

    @property
    def num_decisions(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_envs(self) -> int:
        return self.rewards.shape[1]

    def present_optional(self) -> tuple[str, ...]:
        return tuple(name for name in self.OPTIONAL_PER_DECISION if getattr(self, name) is not None)

    def observations(self, after_chunk: bool = False) -> Observation:
        """The (T, N) observations the chunks were chosen in (or, after_chunk, those they led to), as one
        numpy record; `.flatten_leading()` makes it a batch of B = T * N."""
        return Observation(self.next_obs if after_chunk else self.obs, self.next_images if after_chunk else self.images,
                           self.tokens, self.token_mask)  # fmt: skip

    def validate(self, finite: bool = True) -> None:
        """Shapes and dtypes agree and (with `finite`) every float is finite; raises ValueError / NonFiniteError naming
        the field. The learner checks finiteness itself, inside the update it can roll back (Learner.update)."""
        leading = (self.num_decisions, self.num_envs)
        for name in self.PER_DECISION + self.present_optional():
            array = getattr(self, name)
            if array.shape[:2] != leading:
                raise ValueError(f"RolloutBatch.{name} has shape {array.shape}, expected leading dims {leading}")
        if (self.images is None) != (self.next_images is None):
            raise ValueError("RolloutBatch.images and RolloutBatch.next_images must be given together")
        try:
            self.observations(), self.observations(after_chunk=True)  # dtypes: uint8 frames, int64 tokens, bool mask
        except ValueError as exc:
            raise ValueError(f"rollout from actor {self.actor_index}: {exc}") from exc
        if self.episode_tasks and len(self.episode_tasks) != len(self.episode_successes):
            raise ValueError(f"RolloutBatch.episode_tasks names {len(self.episode_tasks)} episodes, expected {len(self.episode_successes)}")
        if finite:
            check_finite_arrays({name: getattr(self, name) for name in self.PER_DECISION}, f"rollout from actor {self.actor_index}")

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Join batches of the same length along the env axis (actor order is kept)."""
        if len({b.num_decisions for b in batches}) != 1:
            raise ValueError(f"rollouts have different lengths {[b.num_decisions for b in batches]}")
        optional = {b.present_optional() for b in batches}
        if len(optional) != 1:
            raise ValueError(f"rollouts carry different observation fields {sorted(optional)}: actors built with different policy configs?")
        names = RolloutBatch.PER_DECISION + optional.pop()
        per_decision = {n: np.concatenate([getattr(b, n) for b in batches], axis=1) for n in names}
        per_episode = {
            n: np.concatenate([getattr(b, n) for b in batches]) for n in ("episode_returns", "episode_successes", "episode_lengths")
        }
        return RolloutBatch(
            **per_decision,
            **per_episode,
            weight_version=min(b.weight_version for b in batches),
            actor_index=-1,
            sample_seconds=max(b.sample_seconds for b in batches),
            env_steps=sum(b.env_steps for b in batches),
            actor_precision=", ".join(sorted({b.actor_precision for b in batches})),
            policy_cpu_seconds=sum(b.policy_cpu_seconds for b in batches),
            env_cpu_seconds=sum(b.env_cpu_seconds for b in batches),
            episode_tasks=sum((b.episode_tasks for b in batches), ()),
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
