"""The records that cross the object store: a rollout with compact frames and tokens, and the published weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.trajectory import RolloutBatch, WeightsPayload


def rollout_with_frames(num_envs: int = 2) -> RolloutBatch:
    rng = np.random.default_rng(0)
    t, k, h, a = 3, 2, 4, 4
    floats = {name: rng.normal(size=(t, num_envs)).astype(np.float32) for name in ("rewards", "discounts", "values", "log_probs",
                                                                                    "log_probs_per_element")}  # fmt: skip
    return RolloutBatch(
        obs=rng.normal(size=(t, num_envs, 39)).astype(np.float32), next_obs=rng.normal(size=(t, num_envs, 39)).astype(np.float32),
        chains=np.zeros((t, num_envs, k + 1, h, a), np.float32), actions=np.zeros((t, num_envs, h, a), np.float32),
        terminated=np.zeros((t, num_envs), bool), truncated=np.zeros((t, num_envs), bool), valid=np.ones((t, num_envs), bool), **floats,
        episode_returns=np.zeros(0, np.float32), episode_successes=np.zeros(0, bool), episode_lengths=np.zeros(0, np.int64),
        weight_version=0, actor_index=0, sample_seconds=0.0, env_steps=0,
        images=rng.integers(0, 256, (t, num_envs, 1, 8, 8, 3), dtype=np.uint8),
        next_images=rng.integers(0, 256, (t, num_envs, 1, 8, 8, 3), dtype=np.uint8),
        tokens=np.tile(np.arange(5), (t, num_envs, 1)), token_mask=np.ones((t, num_envs, 5), bool), actor_precision="bfloat16 on cuda:0",
    )  # fmt: skip


def test_rollout_record_carries_compact_frames_and_tokens() -> None:
    batch = rollout_with_frames()
    batch.validate()
    flat = batch.observations(after_chunk=True).flatten_leading()
    assert flat.batch_shape == (6,)
    np.testing.assert_array_equal(flat.images[3], batch.next_images[1, 1])
    joined = RolloutBatch.concat([batch, rollout_with_frames(3)])
    assert joined.images.shape == (3, 5, 1, 8, 8, 3) and joined.tokens.shape == (3, 5, 5)
    np.testing.assert_array_equal(joined.images[:, 2:], rollout_with_frames(3).images)
    float_frames = dataclasses.replace(batch, images=batch.images.astype(np.float32))
    with pytest.raises(ValueError, match=r"actor 0: Observation\.images must be uint8"):
        float_frames.validate()
    with pytest.raises(ValueError, match="images and RolloutBatch.next_images must be given together"):
        dataclasses.replace(batch, next_images=None).validate()
    with pytest.raises(ValueError, match="different observation fields"):
        RolloutBatch.concat([batch, dataclasses.replace(batch, images=None, next_images=None)])


def test_a_payload_shares_the_weights_it_was_made_from_unless_copied() -> None:
    """The learner publishes views of its weights, which ray.put serialises at once (tests/e2e/test_system.py); a copy
    is for a payload that outlives the next update in this process."""
    weight = torch.zeros(1000)
    assert np.shares_memory(WeightsPayload.from_state(7, {"w": weight}, copy=False).params["w"], weight.numpy())
    assert not np.shares_memory(WeightsPayload.from_state(7, {"w": weight}).params["w"], weight.numpy())
