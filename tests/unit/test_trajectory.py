"""The records that cross the object store: a rollout with compact frames and tokens, and the published weights."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from common.diagnostics import NonFiniteError
from common.observation import Observation
from common.trajectory import RolloutBatch, WeightsPayload


def rollout_with_frames(num_envs: int = 2, ended: tuple[tuple[int, int], ...] = ()) -> RolloutBatch:
    """A record of 3 decisions in `num_envs` envs, whose episodes ended at the (decision, env) pairs of `ended`."""
    rng = np.random.default_rng(num_envs)
    t, k, h, a = 3, 2, 4, 4
    floats = {name: rng.normal(size=(t, num_envs)).astype(np.float32) for name in ("rewards", "discounts", "log_probs",
                                                                                    "log_probs_per_element")}  # fmt: skip
    terminated = np.zeros((t, num_envs), bool)
    terminated[tuple(np.array(ended, dtype=np.int64).reshape(-1, 2).T)] = True
    bootstrap_at = np.argwhere(terminated | (np.arange(t) == t - 1)[:, None])  # in (decision, env) order
    obs = Observation(rng.normal(size=(t, num_envs, 39)).astype(np.float32),
                      rng.integers(0, 256, (t, num_envs, 1, 8, 8, 3), dtype=np.uint8),
                      np.tile(np.arange(5) + 10 * np.arange(num_envs)[:, None], (t, 1, 1)), np.ones((t, num_envs, 5), bool))  # fmt: skip
    bootstrap_obs = Observation(rng.normal(size=(len(bootstrap_at), 39)).astype(np.float32),
                                rng.integers(0, 256, (len(bootstrap_at), 1, 8, 8, 3), dtype=np.uint8))  # fmt: skip
    return RolloutBatch(
        obs=obs, chains=np.zeros((t, num_envs, k + 1, h, a), np.float32), terminated=terminated, truncated=np.zeros((t, num_envs), bool),
        valid=np.ones((t, num_envs), bool), **floats, bootstrap_at=bootstrap_at.astype(np.int64), bootstrap_obs=bootstrap_obs,
        episode_returns=np.zeros(0, np.float32), episode_successes=np.zeros(0, bool), episode_lengths=np.zeros(0, np.int64),
        episode_first=np.zeros(0, bool),
        weight_version=0, actor_index=0, sample_seconds=0.0, env_steps=0, actor_precision="bfloat16 on cuda:0",
    )  # fmt: skip


def test_rollout_record_carries_compact_frames_and_tokens_and_each_observation_once() -> None:
    batch = rollout_with_frames(ended=((0, 1),))
    batch.validate()
    assert batch.bootstrap_at.tolist() == [[0, 1], [2, 0], [2, 1]] and batch.bootstrap_rows().tolist() == [1, 4, 5]
    bootstrap = batch.bootstrap_observations()  # each with its env's instruction
    np.testing.assert_array_equal(bootstrap.tokens, batch.obs.tokens[[0, 2, 2], [1, 0, 1]])
    other = rollout_with_frames(3, ended=((1, 2),))
    joined = RolloutBatch.concat([batch, other])
    joined.validate()
    assert joined.obs.images.shape == (3, 5, 1, 8, 8, 3) and joined.obs.tokens.shape == (3, 5, 5)
    np.testing.assert_array_equal(joined.obs.images[:, 2:], other.obs.images)
    # The bootstrap rows stay in (decision, env) order across the actors' envs, each with its observation.
    assert joined.bootstrap_at.tolist() == [[0, 1], [1, 4], [2, 0], [2, 1], [2, 2], [2, 3], [2, 4]]
    either = np.concatenate([batch.bootstrap_obs.state, other.bootstrap_obs.state])
    np.testing.assert_array_equal(joined.bootstrap_obs.state, either[[0, 3, 1, 2, 4, 5, 6]])


def unchecked(obs: Observation, **fields) -> Observation:
    """A copy of `obs` with `fields` set, not validated (as a record that crossed the object store is not)."""
    changed = copy.copy(obs)
    vars(changed).update(fields)
    return changed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {"obs": unchecked(b.obs, images=b.obs.images.astype(np.float32))}, r"actor 0: Observation\.images must be uint8"),
        (lambda b: {"rewards": b.rewards[:2]}, r"RolloutBatch\.rewards has shape \(2, 2\), expected leading dims \(3, 2\)"),
        (lambda b: {"bootstrap_at": b.bootstrap_at[1:]}, "must name, in order, every decision whose episode ended and every env's last"),
        (lambda b: {"bootstrap_at": b.bootstrap_at[::-1].copy()}, "must name, in order"),
        (lambda b: {"bootstrap_at": b.bootstrap_at.astype(np.int32)}, r"bootstrap_at must be \(M, 2\) int64"),
        (lambda b: {"bootstrap_obs": b.bootstrap_obs.index(slice(1, None))}, r"bootstrap_obs must hold \['images', 'state'\] of the 3"),
        (lambda b: {"bootstrap_obs": Observation(b.bootstrap_obs.state)}, r"got \(3,\) rows of \['state'\]"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(change, message) -> None:
    batch = rollout_with_frames(ended=((0, 1),))
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(batch, **change(batch)).validate()


def test_a_nonfinite_record_is_refused_naming_the_field() -> None:
    batch = rollout_with_frames()
    state = batch.bootstrap_obs.state.copy()
    state[0, 3] = np.nan
    with pytest.raises(NonFiniteError, match="bootstrap_obs"):
        dataclasses.replace(batch, bootstrap_obs=Observation(state, batch.bootstrap_obs.images)).validate()


def with_image_embeddings(batch: RolloutBatch) -> RolloutBatch:
    """`batch` as an actor that sends its vision tower's tokens records it: 4 tokens of width 6 per camera in place of each
    decision's frames; the bootstrap observations, which no decision read, keep theirs."""
    tokens = np.random.default_rng(1).normal(size=(*batch.obs.batch_shape, 1, 4, 6)).astype(np.float32)
    return dataclasses.replace(batch, obs=dataclasses.replace(batch.obs, images=None, image_embeddings=tokens))


def test_a_record_of_vision_tokens_keeps_the_frames_no_decision_read() -> None:
    batch = with_image_embeddings(rollout_with_frames(ended=((0, 1),)))
    batch.validate()
    joined = RolloutBatch.concat([batch, with_image_embeddings(rollout_with_frames(3))])
    joined.validate()
    assert joined.obs.image_embeddings.shape == (3, 5, 1, 4, 6) and joined.obs.images is None
    assert joined.bootstrap_obs.images.shape == (len(joined.bootstrap_at), 1, 8, 8, 3)
    with pytest.raises(ValueError, match=r"bootstrap_obs must hold \['images', 'state'\] of the 3 bootstrap rows"):
        dataclasses.replace(batch, bootstrap_obs=Observation(batch.bootstrap_obs.state)).validate()
    broken = batch.obs.image_embeddings.copy()
    broken[1, 0, 0, 2, 3] = np.inf
    with pytest.raises(NonFiniteError, match=r"obs\.image_embeddings"):
        dataclasses.replace(batch, obs=dataclasses.replace(batch.obs, image_embeddings=broken)).validate()
    with pytest.raises(ValueError, match="different observation fields"):
        RolloutBatch.concat([batch, rollout_with_frames()])


def test_records_with_other_observation_fields_are_not_joined() -> None:
    batch = rollout_with_frames()
    with pytest.raises(ValueError, match="different observation fields"):
        RolloutBatch.concat([batch, dataclasses.replace(batch, obs=Observation(batch.obs.state))])


def test_a_payload_shares_the_weights_it_was_made_from_unless_copied() -> None:
    """The learner publishes views of its weights, which ray.put serialises at once (tests/e2e/test_system.py); a copy
    is for a payload that outlives the next update in this process."""
    weight = torch.zeros(1000)
    assert np.shares_memory(WeightsPayload.from_state(7, {"w": weight}, copy=False).params["w"], weight.numpy())
    assert not np.shares_memory(WeightsPayload.from_state(7, {"w": weight}).params["w"], weight.numpy())
