"""Camera frames and the learner's features: frames rendered once per chunk in the chunked env, cached vs re-encoded
features in the learner, the behaviour-gap warning of a bfloat16 actor."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

from actors.rollout_actor import RolloutActor
from common.diagnostics import BehaviourGapWarning
from common.policy import FlowPolicy
from common.suites.metaworld import ImageConfig, Layout, MetaworldTaskEnv
from common.vector_env import ChunkedVectorEnv
from learner.update.learner import Learner
from tests.conftest import tiny_config


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
    config = tiny_config(tmp_path, **{"actors.speed.precision": "bfloat16"})
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    batch = RolloutActor(config, 0, bc_checkpoint).sample(learner.broadcast(), 0)
    assert batch.actor_precision == "bfloat16 autocast over float32 weights on cpu" and batch.chains.dtype == np.float32
    with pytest.warns(BehaviourGapWarning, match="actors bfloat16 autocast over float32 weights on cpu, learner float32 on cpu"):
        metrics = learner.update(batch)
    assert metrics["logprob/behaviour_gap_max"] > config.learner.behaviour_gap_warn
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5  # the learner's own old and new log-probs still agree
