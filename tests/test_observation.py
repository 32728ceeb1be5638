"""The observation record and its plumbing: validation, torch conversion, feature slicing, camera frames in the
chunked env and the rollout record, cached vs re-encoded features in the learner, the behaviour-gap warning."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch

from actors.rollout_actor import RolloutActor
from common.diagnostics import BehaviourGapWarning
from common.observation import Observation
from common.policy import FlowPolicy, index_features
from common.suites.metaworld import ImageConfig, Layout, MetaworldTaskEnv
from common.trajectory import RolloutBatch
from common.vector_env import ChunkedVectorEnv
from learner.learner import Learner
from tests.conftest import tiny_config


def example(batch: int = 5, cameras: int = 2, length: int = 7) -> Observation:
    rng = np.random.default_rng(0)
    return Observation(
        state=rng.normal(size=(batch, 39)).astype(np.float32),
        images=rng.integers(0, 256, size=(batch, cameras, 8, 8, 3), dtype=np.uint8),
        tokens=rng.integers(0, 100, size=(batch, length)),
        token_mask=rng.random((batch, length)) < 0.7,
    )


def test_bad_fields_are_named() -> None:
    obs = example()
    with pytest.raises(ValueError, match=r"Observation\.images must be uint8.*never as floats"):
        Observation(obs.state, obs.images.astype(np.float32))
    with pytest.raises(ValueError, match="tokens and Observation.token_mask must be given together"):
        Observation(obs.state, tokens=obs.tokens)
    with pytest.raises(ValueError, match=r"Observation\.images has shape \(4, 2, 8, 8, 3\)"):
        Observation(obs.state, obs.images[:4])
    with pytest.raises(ValueError, match=r"Observation\.token_mask must be bool"):
        Observation(obs.state, tokens=obs.tokens, token_mask=obs.token_mask.astype(np.int64))
    with pytest.raises(ValueError, match="3 RGB channels"):
        Observation(obs.state, obs.images[..., :2].copy())


def test_to_torch_copies_read_only_arrays_and_keeps_dtypes() -> None:
    obs = example()
    for array in obs.present().values():
        array.setflags(write=False)  # as arrays handed out by Ray's object store are
    torch_obs = obs.to_torch("cpu")
    assert [t.dtype for t in torch_obs.present().values()] == [torch.float32, torch.uint8, torch.int64, torch.bool]
    torch_obs.images[0] = 0  # writable, and a copy: the shared array is untouched
    assert obs.images[0].any()
    np.testing.assert_array_equal(torch_obs.state.numpy(), obs.state)


@pytest.mark.parametrize("as_torch", [False, True])
def test_index_and_concat_are_inverse(as_torch: bool) -> None:
    obs = example(batch=6)
    obs = obs.to_torch() if as_torch else obs
    rows = torch.tensor([4, 0, 3]) if as_torch else np.array([4, 0, 3])
    picked = obs.index(rows)
    assert picked.batch_shape == (3,)
    np.testing.assert_array_equal(np.asarray(picked.images[0]), np.asarray(obs.images[4]))
    joined = Observation.concat([obs.index(slice(0, 2)), obs.index(slice(2, 6))])
    for name, array in obs.present().items():
        np.testing.assert_array_equal(np.asarray(getattr(joined, name)), np.asarray(array))
    with pytest.raises(ValueError, match="fields"):
        Observation.concat([obs, Observation(obs.state)])


def test_records_of_decisions_flatten_to_one_batch() -> None:
    per_decision = Observation(np.zeros((3, 2, 39), np.float32), np.zeros((3, 2, 1, 4, 4, 3), np.uint8))
    assert per_decision.batch_shape == (3, 2)
    flat = per_decision.flatten_leading()
    assert flat.batch_shape == (6,) and flat.images.shape == (6, 1, 4, 4, 3)
    env_axis = Observation.concat([per_decision, per_decision], axis=1)
    assert env_axis.batch_shape == (3, 4)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Nested:
    cache: tuple[torch.Tensor, ...]
    by_name: dict[str, torch.Tensor]
    pair: Pair
    shared: float | None


def test_index_features_slices_every_tensor_of_any_structure() -> None:
    batch = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    features = Nested((batch, batch * 2), {"mask": batch > 4}, Pair(batch[:, 0], batch + 1), 0.5)
    rows = torch.tensor([7, 1, 1])
    sliced = index_features(features, rows)
    assert isinstance(sliced, Nested) and isinstance(sliced.pair, Pair) and sliced.shared == 0.5
    torch.testing.assert_close(sliced.cache[1], batch[rows] * 2, rtol=0, atol=0)
    torch.testing.assert_close(sliced.by_name["mask"], batch[rows] > 4, rtol=0, atol=0)
    torch.testing.assert_close(sliced.pair.a, batch[rows, 0], rtol=0, atol=0)
    torch.testing.assert_close(index_features(batch, slice(2, 4)), batch[2:4], rtol=0, atol=0)


def test_chunked_env_renders_frames_once_per_chunk_and_after_resets() -> None:
    """Frames match the per-step `image` observation of an env in the same state (the right-way-up path tested
    in test_envs), the frame after an episode's end is its final scene, and the next one the reset scene."""
    camera = ImageConfig(32, 32, "corner")
    envs = [MetaworldTaskEnv("pick-place-v3", max_episode_steps=6, cameras=[camera, ImageConfig(32, 32, "topview")]) for _ in range(2)]
    vec = ChunkedVectorEnv(envs, [Layout("pick-place-v3", 0, 3), Layout("pick-place-v3", 0, 9)], gamma=0.99)
    start = vec.reset(seed=0)
    assert start.images.shape == (2, 2, 32, 32, 3) and start.images.dtype == np.uint8
    reference = MetaworldTaskEnv("pick-place-v3", max_episode_steps=6, image=camera)
    first_frame = reference.reset(options={"layout": envs[0].layout})[0]["image"]
    np.testing.assert_array_equal(start.images[0, 0], first_frame)
    chunk = np.random.default_rng(0).uniform(-1, 1, (2, 4, 4)).astype(np.float32)
    first = vec.step_chunk(chunk)
    final_frame = None
    for action in chunk[0]:
        final_frame = reference.step(action)[0]["image"]
    np.testing.assert_array_equal(first.next_obs.images[0, 0], final_frame)
    second = vec.step_chunk(chunk)  # steps 5-6 of 6: every episode ends, then resets
    assert second.truncated.all() and not np.array_equal(second.next_obs.images, second.obs.images)
    reset_frame = reference.reset(options={"layout": envs[0].layout})[0]["image"]
    np.testing.assert_array_equal(second.obs.images[0, 0], reset_frame)
    with pytest.raises(ValueError, match="same cameras"):
        ChunkedVectorEnv([envs[0], MetaworldTaskEnv("pick-place-v3")], [Layout("pick-place-v3", 0, 0)], gamma=0.99)
    vec.close()
    reference.close()


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


def test_cached_features_update_exactly_like_re_encoding(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """The MLP's encoder is frozen, so the learner encodes once per iteration (obs, and the next observations no
    decision read, each by micro-batch); forcing the per-micro-batch path gives bit-identical weights, with one more
    encode() per micro-batch of the update."""
    config = tiny_config(tmp_path, **{"algorithm.grad_accum": 2})
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    results = {}
    for trainable in (False, True):
        policy = FlowPolicy.from_pretrained(bc_checkpoint)
        monkeypatch.setattr(type(policy), "encoder_is_trainable", property(lambda self, value=trainable: value))
        calls = []
        original = policy.encode
        policy.encode = lambda obs, original=original, calls=calls: calls.append(obs.batch_shape[0]) or original(obs)
        learner = Learner(config, policy)
        metrics = learner.update(batch)
        results[trainable] = (policy.state_dict(), len(calls), metrics["ppo/optimizer_steps"])
    cached_state, cached_calls, steps = results[False]
    fresh_state, fresh_calls, _ = results[True]
    micro = config.algorithm.minibatch_size // config.algorithm.grad_accum
    chunks = math.ceil(batch.num_decisions * batch.num_envs / micro)  # prepare's encodes of obs
    unread = batch.num_envs + int((batch.terminated | batch.truncated)[:-1].sum())  # the last decision's, and episode ends
    chunks += math.ceil(unread / micro)  # and of the next observations no decision read
    assert chunks > 2 and max(calls) <= micro
    assert cached_calls == chunks and fresh_calls == chunks + steps * 2  # two micro-batches per minibatch
    for name, tensor in cached_state.items():
        assert torch.equal(tensor, fresh_state[name]), name


def test_behaviour_gap_warning_names_both_precisions(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    on_policy = dataclasses.replace(batch, weight_version=learner.version, actor_precision="bfloat16 on cuda:0")
    shifted = dataclasses.replace(on_policy, log_probs=on_policy.log_probs + 0.01)  # a bf16-sized disagreement
    with pytest.warns(BehaviourGapWarning, match=r"actors bfloat16 on cuda:0, learner float32 on cpu; actors and learner run different"):
        metrics = learner.prepare(shifted).metrics
    assert metrics["logprob/behaviour_gap_max"] == pytest.approx(0.01, abs=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BehaviourGapWarning)
        learner.prepare(on_policy)  # the fp32 actor's own log-probs: gap far below the threshold
        config.learner.behaviour_gap_warn = None
        learner.prepare(shifted)


def test_bfloat16_actors_against_a_float32_learner_warn_and_still_pass_the_ratio_check(tmp_path, bc_checkpoint) -> None:
    """A real precision gap: the actor samples under a bfloat16 autocast, the learner rescores in float32."""
    config = tiny_config(tmp_path, **{"actors.precision": "bfloat16"})
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    batch = RolloutActor(config, 0, bc_checkpoint).sample(learner.broadcast(), 0)
    assert batch.actor_precision == "bfloat16 autocast over float32 weights on cpu" and batch.chains.dtype == np.float32
    with pytest.warns(BehaviourGapWarning, match="actors bfloat16 autocast over float32 weights on cpu, learner float32 on cpu"):
        metrics = learner.update(batch)
    assert metrics["logprob/behaviour_gap_max"] > config.learner.behaviour_gap_warn
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5  # the learner's own old and new log-probs still agree
