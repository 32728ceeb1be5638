"""Checks every lerobot VLA backend passes (tests/integration/test_smolvla.py and test_pi0.py call them on their tiny models):
each takes a policy (common.policy.vla_common.VLAFlowPolicy) and observations of it, and asserts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch._dynamo.utils import counters

from bench.op_count import OpCounter
from common.config import RunConfig
from common.diagnostics import check_ratio_is_one
from common.flow import ChainSample, chain_log_prob, compile_steps, gaussian_step, sample_chain, step_time, transition
from common.observation import Observation
from common.policy import CheckpointError, FlowPolicy
from common.rl import normalize, ppo_policy_loss, value_loss


def check_sampling_reads_frames_instruction_and_state(policy: FlowPolicy, obs: Observation) -> None:
    """A chain of 4 decisions samples with bounded, non-constant noise, and the velocity moves when the frames, the
    instruction or the state change; missing frames and sigma before velocity are one-line errors."""
    batch = obs.state.shape[0]
    with torch.no_grad():
        sample = sample_chain(policy, policy.encode(obs), batch, generator=torch.Generator().manual_seed(1))
    assert sample.chain.shape == (batch, policy.num_steps + 1, policy.chunk_size, policy.action_dim) and torch.isfinite(sample.chain).all()
    std = sample.scores.std
    assert std.min() >= 0.05 - 1e-6 and std.max() <= 0.15 + 1e-6 and std.std() > 0  # bounded, and not constant

    a_t, t = torch.randn(batch, policy.chunk_size, policy.action_dim), torch.full((batch,), 0.25)

    def velocity_for(changed: Observation) -> Tensor:
        with torch.no_grad():
            return policy.velocity(a_t, t, policy.encode(changed))

    base = velocity_for(obs)
    other_frames = dataclasses.replace(obs, images=255 - obs.images)
    other_words = dataclasses.replace(obs, tokens=obs.tokens.roll(1, dims=0), token_mask=obs.token_mask.roll(1, dims=0))
    other_state = dataclasses.replace(obs, state=obs.state + 1.0)
    for changed in (other_frames, other_words, other_state):
        assert (velocity_for(changed) - base).abs().max() > 1e-4
    with pytest.raises(ValueError, match="images"):
        policy.encode(Observation(state=obs.state))
    with torch.no_grad():  # the noise head reads the action through the expert's hidden state of the velocity's pass
        velocity, std = policy.velocity_and_sigma(a_t, t, policy.encode(obs))
        _, other_std = policy.velocity_and_sigma(a_t + 1.0, t, policy.encode(obs))
    assert torch.equal(velocity, base) and (std - other_std).abs().max() > 0


def check_cameras_share_one_vision_pass(policy: FlowPolicy, obs: Observation, owner: nn.Module) -> None:
    """encode() embeds every camera's frames with one call of `owner.embed_image` (the vision tower), and its prefix
    is what lerobot's embed_prefix gives with its own loop, one call per camera."""
    embed_image, batches = owner.embed_image, []

    def counted(images: Tensor) -> Tensor:
        batches.append(images.shape[0])
        return embed_image(images)

    owner.embed_image = counted
    try:
        with torch.no_grad():
            one_pass = policy.encode(obs)
            one_pass_batches = batches.copy()
            batches.clear()
            with (mock.patch(f"{type(policy).__module__}.one_vision_pass", lambda _owner, _images, _embedded: contextlib.nullcontext()),
                  mock.patch.object(policy, "camera_embeddings", lambda *_: None)):  # fmt: skip
                looped = policy.encode(obs)
    finally:
        del owner.embed_image
    cameras, rows = len(policy.config.cameras), obs.state.shape[0]
    assert cameras > 1
    assert one_pass_batches == [cameras * rows] and batches == [rows] * cameras
    for fast, plain in zip((*one_pass.key_states, *one_pass.value_states, one_pass.critic_input),
                           (*looped.key_states, *looped.value_states, looped.critic_input), strict=True):  # fmt: skip
        torch.testing.assert_close(fast, plain, rtol=0.0, atol=1e-6)


def check_recorded_image_tokens_encode_as_the_frames(policy: FlowPolicy, obs: Observation, owner: nn.Module) -> None:
    """A VLA that sends its vision tower's tokens (send_image_embeddings, set by actors.speed.send_image_embeddings) keeps
    them in its features as (B, C, T, D) float32, row b's camera c the tower's tokens of that frame alone; an observation
    carrying them in place of the frames encodes, with no pass of `owner`'s tower, to the same prefix cache and critic
    input bit for bit, and keeps no tokens of its own."""
    policy.send_image_embeddings = True
    try:
        with torch.no_grad():
            features = policy.encode(obs)
    finally:
        policy.send_image_embeddings = False
    tokens = policy.recorded_image_embeddings(features)
    batch, cameras = obs.state.shape[0], len(policy.config.cameras)
    assert cameras > 1 and batch > 1 and tokens.dtype == torch.float32 and tokens.shape[:2] == (batch, cameras)
    images = policy.lerobot_inputs(obs)[0]  # each camera's (B, 3, S, S) frames as the tower reads them
    with torch.no_grad():
        for camera in range(cameras):
            for row in (0, batch - 1):
                alone = owner.embed_image(images[camera][row : row + 1])[0].float()
                torch.testing.assert_close(tokens[row, camera], alone, rtol=0.0, atol=1e-5)
    recorded = Observation(state=obs.state, tokens=obs.tokens, token_mask=obs.token_mask, image_embeddings=tokens)
    embed_image, calls = owner.embed_image, []
    owner.embed_image = lambda frames: calls.append(frames.shape) or embed_image(frames)
    try:
        with torch.no_grad():
            again = policy.encode(recorded)
    finally:
        del owner.embed_image
    assert calls == [] and again.image_embeddings is None and policy.recorded_image_embeddings(again) is None

    def kept(encoded: object) -> list[Tensor]:
        return [*encoded.key_states, *encoded.value_states, encoded.critic_input, encoded.prefix_pad_mask]

    assert all(torch.equal(read, fresh) for read, fresh in zip(kept(again), kept(features), strict=True))
    with pytest.raises(ValueError, match=r"Observation\.image_embeddings has 1 cameras"):
        policy.encode(dataclasses.replace(recorded, image_embeddings=tokens[:, :1]))


def check_noise_off_chain_reproduces_lerobot(policy: FlowPolicy, obs: Observation, start: str, sample_actions: Callable) -> None:
    """The project's Euler chain with the noise off == lerobot's own sampler (`sample_actions(noise=x0)` on the same
    observations), same weights, same x_0 (zeros: sample_chain's deterministic mode; or Gaussian), within 1e-5."""
    batch = obs.state.shape[0]
    shape = (batch, policy.chunk_size, policy.action_dim)
    x0 = torch.zeros(shape) if start == "zero" else torch.randn(shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = policy.encode(obs)
        if start == "zero":
            ours = sample_chain(policy, features, batch, deterministic=True).chain[:, -1]
        else:
            ours = x0
            for k in range(policy.num_steps):
                ours, _ = transition(policy, features, ours, k)
        theirs = sample_actions(noise=x0)
    assert theirs.abs().max() > 0.1  # a real trajectory, not zeros on both sides
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def check_prefix_cache_kept(policy: FlowPolicy, obs: Observation) -> None:
    """lerobot 0.6's denoise_step appends the action tokens to its DynamicCache and crops them off in place; every
    velocity call gets a cache of its own, so the kept keys and values stay the prefix's, bit for bit, and the
    same call after a whole chain gives the same velocity. The critic reads none of that cache: the learner keeps only
    critic_features of the observations it values."""
    batch = obs.state.shape[0]
    a_t = torch.randn(batch, policy.chunk_size, policy.action_dim, generator=torch.Generator().manual_seed(16))
    t = torch.full((batch,), 0.5)
    with torch.no_grad():
        features = policy.encode(obs)
        kept = [tensor.clone() for tensor in features.key_states + features.value_states]
        first = policy.velocity(a_t, t, features)
        sample_chain(policy, features, batch, generator=torch.Generator().manual_seed(17))
        again = policy.velocity(a_t, t, features)
    assert torch.equal(first, again)
    assert all(keys.shape[1] == features.prefix_pad_mask.shape[1] for keys in features.key_states)
    assert all(torch.equal(before, after) for before, after in zip(kept, features.key_states + features.value_states))
    critic_only = policy.critic_features(features)
    assert not critic_only.key_states + critic_only.value_states
    assert torch.equal(policy.value(critic_only), policy.value(features))


def check_learner_log_probs_equal_actor_log_probs(policy: FlowPolicy, obs: Observation, directory: Path) -> None:
    """Actor: a checkpoint loaded in eval mode samples. Learner: another copy in train mode re-encodes and rescores.
    Same weights, so the ratio is 1 within 1e-5 (the learner's check passes), and the graph reaches the heads."""
    policy.save_pretrained(directory)
    actor = FlowPolicy.from_pretrained(directory).eval()
    learner = type(policy).from_pretrained(directory).train()
    batch = obs.state.shape[0]
    with torch.no_grad():
        sample = sample_chain(actor, actor.encode(obs), batch, generator=torch.Generator().manual_seed(5))
    rescored = chain_log_prob(learner, learner.encode(obs), sample.chain)
    logratio = rescored.log_prob - sample.scores.log_prob
    assert check_ratio_is_one(logratio, learner, tolerance=1e-5) <= 1e-5
    rescored.log_prob.sum().backward()
    assert learner.noise_head[0].weight.grad is not None and learner.vla.model.action_out_proj.weight.grad is not None


def bf16_actor_gap(policy: FlowPolicy, actor: FlowPolicy, obs: Observation) -> float:
    """The largest log-prob gap between chains a reduced-precision `actor` samples and the float32 `policy` scores."""
    with torch.no_grad():
        sample = sample_chain(actor, actor.encode(obs), obs.state.shape[0], generator=torch.Generator().manual_seed(13))
        rescored = chain_log_prob(policy, policy.encode(obs), sample.chain)
    return float((rescored.log_prob - sample.scores.log_prob).abs().max())


def encoded_chain(policy: FlowPolicy, obs: Observation, seed: int) -> tuple[object, Tensor]:
    """The observations' features and one stochastic chain sampled on them, without gradients."""
    with torch.no_grad():
        features = policy.encode(obs)
        generator = torch.Generator().manual_seed(seed)
        return features, sample_chain(policy, features, obs.batch_shape[0], deterministic=False, generator=generator).chain


@contextlib.contextmanager
def bytes_kept_for_backward() -> Iterator[list[int]]:
    """The sizes of the tensors autograd keeps for backward passes while the block runs, one entry per saved tensor."""
    kept: list[int] = []

    def keep(tensor: Tensor) -> Tensor:
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        yield kept


def check_recomputed_steps_keep_less_for_the_same_gradients(policy: FlowPolicy, obs: Observation) -> None:
    """learner.speed.recompute_steps: the same log-probs and gradients, bit for bit, while the backward pass keeps less than
    half the bytes (each step's forward runs again inside it)."""
    features, chain = encoded_chain(policy, obs, seed=3)
    runs = []
    for recompute in (False, True):
        policy.zero_grad(set_to_none=True)
        with bytes_kept_for_backward() as kept:
            log_prob = chain_log_prob(policy, features, chain, recompute).log_prob
        log_prob.sum().backward()
        runs.append((log_prob.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, sum(kept)))
    policy.zero_grad(set_to_none=True)
    (plain, grads, kept_plain), (again, grads_again, kept_again) = runs
    assert torch.equal(plain, again) and grads and grads.keys() == grads_again.keys()
    assert all(torch.equal(grads[name], grads_again[name]) for name in grads)
    assert kept_again < kept_plain / 2, (kept_again, kept_plain)


def check_attention_function_as_eager(fused: Callable[..., Tensor], eager: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> None:
    """An attention function `fused(query, key, value, blind)` against the eager one it replaces, called alike, where
    `blind` False gives a mask under which every query sees a key and True one where some query sees none (a padding
    token of the prefix): the same outputs both ways (-inf in place of the masks' finite lowest value would make the blind
    row NaN), the same gradients where every query sees a key, within bfloat16's rounding on bfloat16 inputs, and finite
    under the learner's bfloat16 autocast."""
    got, want = fused(*inputs, False), eager(*inputs, False)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    for grad, grad_eager in zip(torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(want, inputs, upstream), strict=True):
        torch.testing.assert_close(grad, grad_eager, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(fused(*inputs, True), eager(*inputs, True), rtol=1e-5, atol=1e-6)
        low = [tensor.bfloat16() for tensor in inputs]
        torch.testing.assert_close(fused(*low, True).float(), eager(*low, True).float(), rtol=0.02, atol=0.02)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.isfinite(fused(*inputs, True)).all()


def check_fused_attention_scores_as_eager_and_keeps_less(eager: FlowPolicy, fused: FlowPolicy, obs: Observation) -> None:
    """The policy's fuse_attention (actors.speed.fused_attention, learner.speed.fused_attention), `fused` a copy of
    `eager`: the prefix, the chain's log-probs and their gradients as with the eager attention up to float rounding,
    while the backward pass of the denoising steps keeps fewer bytes; fuse_attention(False) gives the eager one back."""
    fused.fuse_attention()
    (eager_features, chain), (fused_features, _) = encoded_chain(eager, obs, seed=8), encoded_chain(fused, obs, seed=8)
    for got, want in zip(fused_features.key_states, eager_features.key_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_features.critic_input, eager_features.critic_input, rtol=1e-5, atol=1e-5)
    kept: dict[str, int] = {}
    scored = {}
    for name, model, features in (("eager", eager, eager_features), ("fused", fused, fused_features)):
        with bytes_kept_for_backward() as sizes:
            log_prob, grads, _ = scored_with_gradients(model, features, chain, one_pass=False)
        scored[name], kept[name] = (log_prob, grads), sum(sizes)
    assert_same_scores_and_gradients(scored["fused"], scored["eager"])
    assert kept["fused"] < kept["eager"], kept
    assert fused.attention_fused and not eager.attention_fused
    fused.fuse_attention(False)
    assert not fused.attention_fused


def check_fused_attention_in_actor_and_learner(checkpoint: Path, run_config: Callable[[str], RunConfig]) -> None:
    """actors.speed.fused_attention and learner.speed.fused_attention (`run_config(field)`: the tiny run with `field`
    true): an actor attending through one fused kernel samples chains the eager learner scores as its own, and a learner
    attending so starts at ratio 1 and trains the weights to where the eager learner's update puts them, up to float
    rounding."""
    from actors.rollout_actor import RolloutActor
    from learner.update.learner import Learner

    config = run_config("actors.speed.fused_attention")
    actor = RolloutActor(config, 0, checkpoint)
    assert actor.policy.attention_fused
    batch = actor.sample(None, 0)
    eager = Learner(config, FlowPolicy.from_pretrained(checkpoint))
    fused = Learner(run_config("learner.speed.fused_attention"), FlowPolicy.from_pretrained(checkpoint))
    assert fused.policy.attention_fused and not eager.policy.attention_fused
    metrics, metrics_fused = eager.update(batch), fused.update(batch)
    assert metrics["logprob/behaviour_gap_max"] < 1e-5 and metrics_fused["logprob/behaviour_gap_max"] < 1e-5
    assert_trained_alike(checkpoint, (eager, metrics), (fused, metrics_fused), atol=1e-5)


def check_sent_image_embeddings_in_actor_and_learner(checkpoint: Path, frames: RunConfig, sending: RunConfig,
                                                     owner: Callable[[FlowPolicy], nn.Module]) -> None:  # fmt: skip
    """actors.speed.send_image_embeddings (`sending`: the tiny run `frames` with it): the actor samples the chains an actor
    recording frames samples, and records each decision's vision-tower tokens in place of its frames, keeping the frames
    of the observations no decision read. A learner updating on that record runs the tower (`owner(policy)`'s) over
    those observations alone, where on the frames record it runs it over every decision's too, and otherwise makes the
    same update: the same scores, the ratio at 1, the weights within float rounding."""
    from actors.rollout_actor import RolloutActor
    from learner.update.learner import Learner

    with_frames, sent = RolloutActor(frames, 0, checkpoint).sample(None, 0), RolloutActor(sending, 0, checkpoint).sample(None, 0)
    assert with_frames.obs.images is not None and with_frames.obs.image_embeddings is None
    decisions, envs, cameras = sent.num_decisions, sent.num_envs, len(frames.policy.cameras)
    assert sent.obs.images is None and sent.obs.image_embeddings.dtype == np.float32
    assert sent.obs.image_embeddings.shape[:3] == (decisions, envs, cameras) and sent.obs.image_embeddings.std() > 0
    np.testing.assert_array_equal(sent.chains, with_frames.chains)
    np.testing.assert_array_equal(sent.bootstrap_obs.images, with_frames.bootstrap_obs.images)
    updated, embedded = {}, {}
    for name, batch in (("frames", with_frames), ("sent", sent)):
        learner = Learner(frames, FlowPolicy.from_pretrained(checkpoint))
        tower = owner(learner.policy)
        embed_image, embedded[name] = tower.embed_image, []
        tower.embed_image = lambda images, kept=embed_image, seen=embedded[name]: seen.append(images.shape[0]) or kept(images)
        updated[name] = learner, learner.update(batch)
        del tower.embed_image
    bootstrap_rows = len(sent.bootstrap_at) * cameras
    assert sum(embedded["sent"]) == bootstrap_rows and sum(embedded["frames"]) == decisions * envs * cameras + bootstrap_rows
    metrics, metrics_sent = updated["frames"][1], updated["sent"][1]
    for key in ("logprob/old_mean", "values/mean", "logprob/behaviour_gap_max"):
        assert abs(metrics_sent[key] - metrics[key]) <= 1e-6, key
    assert_trained_alike(checkpoint, updated["frames"], updated["sent"], atol=1e-6)


def assert_trained_alike(checkpoint: Path, reference: tuple[Any, dict], other: tuple[Any, dict], atol: float) -> None:
    """Two learners' updates from `checkpoint`'s weights, (learner, metrics) each: the other starts at ratio 1, takes the
    reference's optimiser steps, and puts the trained weights, which the reference moved, within float rounding of its."""
    (reference_learner, metrics), (other_learner, other_metrics) = reference, other
    assert other_metrics["ppo/first_minibatch_ratio_dev"] <= 1e-6
    assert other_metrics["ppo/optimizer_steps"] == metrics["ppo/optimizer_steps"] > 0
    start = dict(FlowPolicy.from_pretrained(checkpoint).named_parameters())
    after, after_other = dict(reference_learner.policy.named_parameters()), dict(other_learner.policy.named_parameters())
    trained = [name for name, p in reference_learner.policy.named_parameters() if p.requires_grad]
    assert any(not torch.equal(after[name], start[name]) for name in trained)
    for name in trained:
        torch.testing.assert_close(after_other[name], after[name], rtol=1e-4, atol=atol)


def check_steps_in_one_pass_give_the_same_gradients_in_fewer_ops(policy: FlowPolicy, obs: Observation) -> None:
    """learner.speed.steps_in_one_pass: the model's K denoising steps as one pass over K x B rows. The same log-probs and
    gradients as step by step, up to float rounding, from fewer than half the ATen ops forward and back (each op a
    kernel launch on a GPU)."""
    features, chain = encoded_chain(policy, obs, seed=4)
    steps, grads, ops_steps = scored_with_gradients(policy, features, chain, one_pass=False)
    one, grads_one, ops_one = scored_with_gradients(policy, features, chain, one_pass=True)
    assert_same_scores_and_gradients((one, grads_one), (steps, grads))
    assert policy.num_steps >= 2 and ops_one < ops_steps / 2, (ops_one, ops_steps)


def scored_with_gradients(policy: FlowPolicy, features: object, chain: Tensor, one_pass: bool) -> tuple[Tensor, dict[str, Tensor], int]:
    """The chains' log-probs, the gradients of their sum, and the ATen ops dispatched forward and back."""
    policy.zero_grad(set_to_none=True)
    with OpCounter() as dispatched:
        log_prob = chain_log_prob(policy, features, chain, steps_in_one_pass=one_pass).log_prob
        log_prob.sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return log_prob.detach(), grads, dispatched.ops


def assert_same_scores_and_gradients(fast: tuple[Tensor, dict[str, Tensor]], plain: tuple[Tensor, dict[str, Tensor]]) -> None:
    """Log-probs within 1e-5 and every gradient within a relative 1e-3: float rounding in larger or fused kernels."""
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    assert plain[1] and plain[1].keys() == fast[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-3, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")


def check_compiled_scoring_gives_the_same_gradients_in_fewer_ops(policy: FlowPolicy, obs: Observation) -> None:
    """learner.speed.compile_steps with learner.speed.steps_in_one_pass: the K denoising steps scored through the compiled step,
    forward and back, with no graph break. The same log-probs and gradients as the eager pass up to float rounding,
    from fewer ATen ops (the rest run fused); the old log-probs, scored without gradients by another graph, set the
    ratio at 1 within the ratio check's tolerance."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    features, chain = encoded_chain(policy, obs, seed=5)
    steps, grads, ops = scored_with_gradients(policy, features, chain, one_pass=True)
    compile_steps(policy, "learner.speed.compile_steps")
    breaks = counters["graph_break"].total()
    try:
        scored_with_gradients(policy, features, chain, one_pass=True)  # compiles
        with torch.no_grad():
            old = chain_log_prob(policy, features, chain, steps_in_one_pass=True).log_prob
        compiled, grads_compiled, ops_compiled = scored_with_gradients(policy, features, chain, one_pass=True)
    finally:
        policy.compiled_step = None
    assert counters["graph_break"].total() == breaks
    assert_same_scores_and_gradients((compiled, grads_compiled), (steps, grads))
    check_ratio_is_one(compiled - old, policy, tolerance=1e-5)
    assert ops_compiled < ops / 2, (ops_compiled, ops)


def check_compiled_steps_follow_the_eager_ones(policy: FlowPolicy, obs: Observation) -> None:
    """actors.speed.compile_steps (common.flow.compile_steps): a denoising step traces as one graph, with no break. On the
    same noise, chains sampled through the compiled steps match the eager ones, and their behaviour log-probs the
    learner's eager rescoring, within 1e-5: the compiled kernels sum in another order, so float32 rounding is all that
    may differ. The compiled step dispatches under a third of the eager step's ATen ops (the rest run fused). Weights
    changed in place, as an actor loads a new version, reach the compiled steps; a batch of another size compiles again
    and matches too."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    batch = obs.state.shape[0]
    with torch.no_grad():
        features = policy.encode(obs)
        action = torch.randn(batch, policy.chunk_size, policy.action_dim, generator=torch.Generator().manual_seed(0))
        t, dt = step_time(policy.num_steps, 1, batch, action.device)
        explained = torch._dynamo.explain(functools.partial(gaussian_step, policy))(features, action, t, dt)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    def sampled(observations: Observation, compiled: Callable | None) -> ChainSample:
        """Chains by the compiled steps (or eagerly, None) on fixed noise."""
        rows = observations.state.shape[0]
        noise = torch.randn((policy.num_steps + 1, rows, policy.chunk_size, policy.action_dim), generator=torch.Generator().manual_seed(1))
        policy.compiled_step = compiled
        try:
            with torch.no_grad():
                return sample_chain(policy, policy.encode(observations), rows, noise=noise)
        finally:
            policy.compiled_step = None

    def assert_close(fast: ChainSample, plain: ChainSample) -> None:
        torch.testing.assert_close(fast.chain, plain.chain, rtol=0, atol=1e-5)
        torch.testing.assert_close(fast.scores.log_prob, plain.scores.log_prob, rtol=0, atol=1e-5)

    compile_steps(policy, "actors.speed.compile_steps")
    compiled, policy.compiled_step = policy.compiled_step, None
    eager, fast = sampled(obs, None), sampled(obs, compiled)
    assert_close(fast, eager)
    with torch.no_grad():
        rescored = chain_log_prob(policy, policy.encode(obs), fast.chain)
    torch.testing.assert_close(rescored.log_prob, fast.scores.log_prob, rtol=0, atol=1e-5)
    with torch.no_grad():
        features = policy.encode(obs)
        counts = []
        for step in (None, compiled):
            policy.compiled_step = step
            with OpCounter() as dispatched:
                transition(policy, features, fast.chain[:, 1], 1)
            counts.append(dispatched.ops)
        policy.compiled_step = None
    assert counts[1] < counts[0] / 3, counts

    with torch.no_grad():  # a new weight version, loaded in place
        policy.vla.model.action_out_proj.weight.mul_(1.5)
        for parameter in policy.noise_head.parameters():
            parameter.add_(0.1)
    moved = sampled(obs, compiled)
    assert (moved.chain - fast.chain).abs().max() > 1e-3 and (moved.scores.std - fast.scores.std).abs().max() > 1e-4
    assert_close(moved, sampled(obs, None))
    fewer = obs.index(slice(0, batch - 1))
    assert_close(sampled(fewer, compiled), sampled(fewer, None))


def check_compiled_vision_follows_the_eager_one(policy: FlowPolicy, obs: Observation) -> None:
    """actors.speed.compile_vision (VLAFlowPolicy.compile_vision): the vision tower traces as one graph, with no break, and
    encode()'s prefix (keys, values, the critic's input) through it matches the eager one within 1e-5: float32
    rounding is all that may differ. The compiled tower dispatches under a third of the eager tower's ATen ops (the
    rest run fused). Weights changed in place, as an actor loads a new version, reach it; a batch of another size
    compiles again and matches too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiles of other tests' policies count towards the recompile limit
    counters.clear()
    policy.compile_vision("actors.speed.compile_vision")
    compiled, policy.compiled_vision = policy.compiled_vision, None

    def encoded(observations: Observation, vision: Callable | None) -> list[Tensor]:
        policy.compiled_vision = vision
        try:
            with torch.no_grad():
                features = policy.encode(observations)
        finally:
            policy.compiled_vision = None
        return [*features.key_states, *features.value_states, features.critic_input]

    def assert_close(fast: list[Tensor], plain: list[Tensor]) -> None:
        for fast_part, plain_part in zip(fast, plain, strict=True):
            torch.testing.assert_close(fast_part, plain_part, rtol=0, atol=1e-5)

    fast, eager = encoded(obs, compiled), encoded(obs, None)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert_close(fast, eager)

    frames = torch.rand(2 * len(policy.config.cameras), 3, policy.config.image_size, policy.config.image_size)
    owner = next(module for module in policy.vla.model.children() if hasattr(module, "embed_image"))
    counts = []
    with torch.no_grad():
        for embed in (owner.embed_image, compiled):
            embed(frames)  # the compiled tower's compile for this batch size, outside the count
            with OpCounter() as dispatched:
                embed(frames)
            counts.append(dispatched.ops)
    assert counts[1] < counts[0] / 3, counts

    patches = next(parameter for name, parameter in policy.named_parameters() if name.endswith("patch_embedding.weight"))
    with torch.no_grad():  # a new weight version, loaded in place
        patches.mul_(1.5)
    moved = encoded(obs, compiled)
    assert (moved[-1] - fast[-1]).abs().max() > 1e-4
    assert_close(moved, encoded(obs, None))
    fewer = obs.index(slice(0, obs.state.shape[0] - 1))
    assert_close(encoded(fewer, compiled), encoded(fewer, None))


def check_train_keeps_the_lerobot_model_in_eval_mode(policy: FlowPolicy, obs: Observation) -> None:
    """With the VLM trainable (its tiny vision tower has attention dropout 0.1), lerobot's own train() no longer keeps
    it in eval mode, so an unguarded train() makes the features random; the backend's train() does not."""
    assert policy.encoder_is_trainable
    policy.train()
    assert policy.training and policy.noise_head.training and policy.critic_head.training
    assert not any(module.training for module in policy.vla.modules())
    with torch.no_grad():
        first, second = policy.encode(obs), policy.encode(obs)
    assert torch.equal(first.critic_input, second.critic_input)

    nn.Module.train(policy, True)  # what the plain nn.Module.train would do: the bug, for contrast
    torch.manual_seed(0)
    with torch.no_grad():
        first, second = policy.encode(obs), policy.encode(obs)
    assert not torch.equal(first.critic_input, second.critic_input)


def module_name(policy: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in policy.named_modules() if m is module)


def ppo_step_changes(policy: FlowPolicy, obs: Observation) -> tuple[set[str], set[str]]:
    """One PPO step (policy and value loss, Adam) on chains the policy sampled -> (names of the parameters it changed,
    names of the trainable ones). Checks on the way: the trainable set is exactly the enabled flag groups', it is what
    is broadcast, the groups partition the parameters, encode() is frozen, and the ratio is 1 before the step."""
    groups = policy.parameter_groups()
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    selected = {
        name
        for group, modules in groups.items()
        if getattr(policy.settings, f"train_{group}")
        for module in modules
        for name, _ in module.named_parameters(prefix=module_name(policy, module))
    }
    assert trainable == selected and set(policy.broadcast_state()) == trainable
    assert policy.broadcast_bytes() == sum(policy.state_dict()[n].numel() * 4 for n in trainable)
    assert not policy.encoder_is_trainable
    owned = [id(p) for modules in groups.values() for m in modules for p in m.parameters()]
    assert len(owned) == len(set(owned)) == len(list(policy.parameters()))

    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    batch = obs.state.shape[0]
    with torch.no_grad():
        features = policy.encode(obs)
        sample = sample_chain(policy, features, batch, generator=torch.Generator().manual_seed(7))
        old_values = policy.value(features)
    policy.train()
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    scores = chain_log_prob(policy, features, sample.chain)
    advantages = normalize(torch.randn(batch, generator=torch.Generator().manual_seed(8)))
    pg_loss, metrics = ppo_policy_loss(scores.log_prob, sample.scores.log_prob, advantages, clip_eps=0.2)
    v_loss, _ = value_loss(policy.value(features), old_values + advantages, old_values, None)
    assert metrics["clipfrac"] == 0.0  # ratio 1 before the step
    optimizer.zero_grad()
    (pg_loss + v_loss).backward()
    optimizer.step()
    return {name for name, p in policy.named_parameters() if not torch.equal(p.detach(), before[name])}, trainable


def check_round_trip_and_strict_refusal(policy: FlowPolicy, directory: Path, dropped: str, **load: str) -> None:
    """save_pretrained then from_pretrained (with `load`'s keyword arguments) gives every tensor back, the buffers
    the file does not hold and the weights transformers ties included (the model is built without initialising its
    weights, and that draws no random numbers); the same directory without the tensor `dropped` is refused with its
    name."""
    policy.save_pretrained(directory)
    rng = torch.get_rng_state()
    loaded = type(policy).from_pretrained(directory, **load)
    assert torch.equal(torch.get_rng_state(), rng)  # lerobot's and transformers' initialisation skipped
    assert loaded.loaded_from and not loaded.training
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    buffers = dict(loaded.named_buffers())
    assert buffers.keys() == dict(policy.named_buffers()).keys()
    for name, buffer in policy.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert len(list(loaded.parameters())) == len(list(policy.parameters()))  # shared parameters stay shared

    weights = load_file(str(directory / "model.safetensors"))
    del weights[dropped]
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=dropped.replace(".", r"\.")):
        FlowPolicy.from_pretrained(directory)


def check_reinit_state_proj(widened: FlowPolicy, file_state: dict[str, Tensor]) -> set[str]:
    """A policy loaded from a lerobot checkpoint with reinit_state_proj: state_proj alone is fresh and as wide as
    its max_state_dim, every other tensor is the file's -> the reinitialised names."""
    loaded = widened.vla.state_dict()
    reinitialised = {k for k in loaded if k.startswith("model.state_proj.")}
    assert reinitialised == {"model.state_proj.weight", "model.state_proj.bias"}
    assert loaded["model.state_proj.weight"].shape[1] == widened.settings.max_state_dim
    bound = widened.settings.max_state_dim**-0.5  # nn.Linear's uniform initialisation, drawn after the model was built unfilled
    for name in reinitialised:
        assert loaded[name].abs().max() <= bound and loaded[name].std() > bound / 4, name
    assert not torch.equal(loaded["model.state_proj.bias"], file_state["model.state_proj.bias"])
    assert set(loaded) - reinitialised <= set(file_state)
    for name in set(loaded) - reinitialised:
        assert torch.equal(loaded[name], file_state[name]), name
    return reinitialised
