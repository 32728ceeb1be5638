"""The learner and rollout actor without Ray: ratio == 1, real updates, NaN guards, exact resume."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from actors.rollout_actor import RolloutActor
from common.config import RunConfig
from common.diagnostics import (
    BehaviourGapWarning,
    MicroBatchSplitWarning,
    NonDeterministicPolicyError,
    NonFiniteError,
    NonFiniteUpdateWarning,
    PrecisionGapWarning,
)
from common.observation import Observation
from common.policy import FlowPolicy
from common.rl import ppo_policy_loss
from common.trajectory import RolloutBatch
from learner.update import algorithms as algorithms_module
from learner.update import learner as learner_module
from learner.update import scoring as scoring_module
from learner.update.learner import Learner, lr_scale
from learner.update.micro_batches import micro_batches_within
from learner.update.numeric_checks import PRECISION_GAP_ROWS
from tests.conftest import tiny_config
from tests.helpers.dropout import with_dropout


@pytest.fixture()
def setup(tmp_path, bc_checkpoint):
    config = tiny_config(tmp_path)
    actor = RolloutActor(config, 0, bc_checkpoint)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    return config, actor, learner


def patch_chain_log_prob(monkeypatch, scored) -> None:
    """`scored` in place of chain_log_prob wherever the learner scores chains: its scoring pass and its update's passes."""
    for module in (scoring_module, learner_module):
        monkeypatch.setattr(module, "chain_log_prob", scored)


def params(policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.state_dict().items()}


def test_update_changes_weights_with_ratio_one_first(setup) -> None:
    config, actor, learner = setup
    actor.load_weights(learner.broadcast())
    batch = actor.sample(None, iteration=0)
    assert batch.chains.shape == (8, 2, 5, 4, 4) and batch.weight_version == 0
    before = params(learner.policy)
    metrics = learner.update(batch)
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert metrics["logprob/behaviour_gap_max"] < 1e-4  # actor and learner score the same chains alike
    changed = [k for k, v in learner.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("velocity_net") for k in changed) and any(k.startswith("critic_net") for k in changed)
    assert not any(k.startswith("obs_") or k.startswith("action_") for k in changed)  # normalisation is fixed
    assert learner.version == 1
    actor.load_weights(learner.broadcast())
    assert actor.version == 1
    assert torch.equal(actor.policy.velocity_net[0].weight, learner.policy.velocity_net[0].weight)


def learner_with(config: RunConfig, checkpoint, **speed: Any) -> Learner:
    """A learner from `checkpoint` with learner.speed.<field> set as given, beside the fixture's."""
    variant = copy.deepcopy(config)
    for name, value in speed.items():
        setattr(variant.learner.speed, name, value)
    return Learner(variant, FlowPolicy.from_pretrained(checkpoint))


def test_recomputed_denoising_steps_update_to_the_same_bits(setup, bc_checkpoint, monkeypatch) -> None:
    """learner.speed.recompute_steps runs each step's forward again in the backward pass: the same update, bit for bit."""
    config, actor, plain = setup
    batch = actor.sample(None, iteration=0)
    again = learner_with(config, bc_checkpoint, recompute_steps=True)
    metrics = plain.update(batch)
    asked, score = [], learner_module.chain_log_prob
    patch_chain_log_prob(monkeypatch, lambda *args, **kwargs: asked.append(args[3:4]) or score(*args, **kwargs))
    metrics_again = again.update(batch)
    assert (True,) in asked  # the update's passes recompute (the scoring pass, without gradients, has nothing to keep)
    after, after_again = params(plain.policy), params(again.policy)
    assert after.keys() == after_again.keys() and all(torch.equal(after[k], after_again[k]) for k in after)
    assert {k: v for k, v in metrics.items() if "seconds" not in k} == {k: v for k, v in metrics_again.items() if "seconds" not in k}


def test_denoising_steps_in_one_pass_update_within_rounding_of_step_by_step(setup, bc_checkpoint, monkeypatch) -> None:
    """learner.speed.steps_in_one_pass scores old and new log-probs alike in one pass of K x B rows: the ratio starts at 1,
    and the update lands where the step-by-step one does, up to float rounding."""
    config, actor, plain = setup
    batch = actor.sample(None, iteration=0)
    one_pass = learner_with(config, bc_checkpoint, steps_in_one_pass=True)
    metrics = plain.update(batch)
    asked, score = [], learner_module.chain_log_prob

    def scored(*args, **kwargs):
        asked.append(kwargs["steps_in_one_pass"] if "steps_in_one_pass" in kwargs else args[4])
        return score(*args, **kwargs)

    patch_chain_log_prob(monkeypatch, scored)
    metrics_one_pass = one_pass.update(batch)
    assert len(asked) > 2 and all(asked)  # the scoring pass and every step
    assert metrics_one_pass["ppo/first_minibatch_ratio_dev"] <= 1e-6
    assert metrics_one_pass["ppo/optimizer_steps"] == metrics["ppo/optimizer_steps"]
    after, after_one_pass = params(plain.policy), params(one_pass.policy)
    start = params(FlowPolicy.from_pretrained(bc_checkpoint))
    assert any(not torch.equal(after[k], start[k]) for k in after)
    for name, value in after.items():
        torch.testing.assert_close(after_one_pass[name], value, rtol=1e-4, atol=1e-5)


def test_compiled_denoising_steps_update_within_rounding_of_the_eager_ones(setup, bc_checkpoint) -> None:
    """learner.speed.compile_steps: the scoring pass (no gradients) and every minibatch's forward and backward run the
    policy's compiled step, traced whole; the ratio starts at 1, and the update lands where the eager one does, up to
    float rounding. Step by step here; in one pass on SmolVLA (tests/test_smolvla_loop.py)."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    config, actor, eager = setup
    batch = actor.sample(None, iteration=0)
    compiled = learner_with(config, bc_checkpoint, compile_steps=True)
    assert eager.policy.compiled_step is None and compiled.policy.compiled_step is not None
    step, grad_modes = compiled.policy.compiled_step, []
    compiled.policy.compiled_step = lambda *args: grad_modes.append(torch.is_grad_enabled()) or step(*args)
    graphs, breaks = counters["stats"]["unique_graphs"], counters["graph_break"].total()
    metrics, metrics_compiled = eager.update(batch), compiled.update(batch)
    assert False in grad_modes and True in grad_modes  # scored and trained through it
    assert counters["stats"]["unique_graphs"] - graphs >= 2 and counters["graph_break"].total() == breaks
    assert metrics_compiled["ppo/first_minibatch_ratio_dev"] <= 1e-6 and metrics_compiled["logprob/behaviour_gap_max"] < 1e-5
    assert metrics_compiled["ppo/optimizer_steps"] == metrics["ppo/optimizer_steps"] > 0
    after, after_compiled = params(eager.policy), params(compiled.policy)
    start = params(FlowPolicy.from_pretrained(bc_checkpoint))
    assert any(not torch.equal(after[k], start[k]) for k in after)
    for name, value in after.items():
        torch.testing.assert_close(after_compiled[name], value, rtol=1e-4, atol=1e-5)


def test_a_gpu_learners_fused_adam_updates_as_the_plain_one_does(setup, bc_checkpoint, monkeypatch, tmp_path) -> None:
    """Where its weights are on a GPU, the learner's Adam runs fused (one kernel per parameter group); on the CPU it is
    the plain loop the recorded runs used. Both update alike, up to float rounding, over the two parameter groups and
    their per-iteration learning rates, with Adam moments carried into the second iteration; each resumes from the
    other's checkpoint and keeps its own kind."""
    config, actor, plain = setup
    assert not plain.optimizer.defaults["fused"]
    with monkeypatch.context() as on_gpu:  # what the learner reads the device from, as a GPU learner would see it
        on_gpu.setattr(FlowPolicy, "obs_device", property(lambda self: torch.device("cuda")))
        fused = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    assert fused.optimizer.defaults["fused"]
    for iteration in range(2):
        batch = actor.sample(plain.broadcast(), iteration)
        metrics, metrics_fused = plain.update(batch), fused.update(batch)
        assert metrics_fused["ppo/optimizer_steps"] == metrics["ppo/optimizer_steps"] > 0
        assert metrics_fused["ppo/first_minibatch_ratio_dev"] <= 1e-5
    after, after_fused = params(plain.policy), params(fused.policy)
    start = params(FlowPolicy.from_pretrained(bc_checkpoint))
    assert any(not torch.equal(after[k], start[k]) for k in after)
    for name, value in after.items():
        torch.testing.assert_close(after_fused[name], value, rtol=0, atol=1e-7)  # far below one update
    # A checkpoint carries its optimiser's fused flag; a learner that resumes from it keeps its own machine's.
    plain.save_checkpoint(tmp_path / "plain")
    fused.save_checkpoint(tmp_path / "fused")
    plain.load_trainer_state(tmp_path / "fused")
    fused.load_trainer_state(tmp_path / "plain")
    assert [group["fused"] for group in plain.optimizer.param_groups] == [False, False]
    assert [group["fused"] for group in fused.optimizer.param_groups] == [True, True]
    batch = actor.sample(plain.broadcast(), 2)
    assert plain.update(batch)["ppo/optimizer_steps"] == fused.update(batch)["ppo/optimizer_steps"] > 0


@pytest.mark.filterwarnings("ignore::common.diagnostics.BehaviourGapWarning")  # float32 actor, bfloat16 learner
def test_a_bfloat16_learner_scores_each_step_with_the_weights_the_step_before_left(setup, bc_checkpoint) -> None:
    """Under learner.speed.precision bfloat16 the update's second optimiser step sees the ratio of the weights after its first:
    the same ratios as scoring the chains afresh, after a one-step update, against the log-probs before it. A stale
    autocast cast of the weights would keep every ratio of the update at exactly 1."""
    config, actor, _ = setup
    batch = actor.sample(None, iteration=0)
    one_step = copy.deepcopy(config)
    one_step.algorithm.update_epochs = 1
    assert batch.num_decisions * batch.num_envs == config.algorithm.minibatch_size  # one minibatch, so one step an epoch
    stepped = learner_with(one_step, bc_checkpoint, precision="bfloat16")
    before = stepped.prepare(batch).old_log_probs
    assert stepped.update(batch)["ppo/optimizer_steps"] == 1
    ratios = (stepped.prepare(batch).old_log_probs - before).exp()
    assert (ratios - 1).abs().max() > 1e-4  # the first step moved the bfloat16 scores
    metrics = learner_with(config, bc_checkpoint, precision="bfloat16").update(batch)
    assert metrics["ppo/optimizer_steps"] == 2 and metrics["ppo/first_minibatch_ratio_dev"] == 0
    assert metrics["ppo/ratio_max"] == pytest.approx(max(1.0, ratios.max().item()), rel=1e-6)
    assert metrics["ppo/ratio_min"] == pytest.approx(min(1.0, ratios.min().item()), rel=1e-6)


@pytest.mark.filterwarnings("ignore::common.diagnostics.BehaviourGapWarning")  # float32 actor, bfloat16 learner
def test_a_bfloat16_learner_reports_its_rounding_against_float32_and_warns_near_the_clip_range(setup, bc_checkpoint) -> None:
    """logprob/precision_gap_max: a bfloat16 learner's old log-probs against a float32 learner's of the same weights and
    chains (the first PRECISION_GAP_ROWS); PrecisionGapWarning once it reaches half of log(1 + clip_eps)."""
    config, actor, exact = setup
    batch = actor.sample(None, iteration=0)
    rows = PRECISION_GAP_ROWS
    assert "logprob/precision_gap_max" not in exact.prepare(batch).metrics  # float32: nothing to compare
    expected = (learner_with(config, bc_checkpoint, precision="bfloat16").prepare(batch).old_log_probs[:rows]
                - exact.prepare(batch).old_log_probs[:rows]).abs().max().item()  # fmt: skip
    assert expected > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionGapWarning)  # this gap is well inside the default clip range
        gap = learner_with(config, bc_checkpoint, precision="bfloat16").prepare(batch).metrics["logprob/precision_gap_max"]
    assert gap == pytest.approx(expected, rel=1e-6) and gap < 0.5 * np.log1p(config.algorithm.clip_eps)
    narrow = copy.deepcopy(config)
    narrow.algorithm.clip_eps = expected  # half of log(1 + clip_eps) is about half the gap
    with pytest.warns(
        PrecisionGapWarning, match=r"bfloat16 rounding moves the learner's log-probs by up to .*learner.speed.precision: float32"
    ):
        learner_with(narrow, bc_checkpoint, precision="bfloat16").prepare(batch)


def test_next_observation_values_encode_only_the_bootstrap_observations(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """A chunk's next observation is its env's next decision's, unless an episode ended in the chunk (or the rollout
    did): the record carries only those others, and the critic's values of the next observations equal those of
    encoding every one the envs returned, bit for bit, while only the bootstrap ones are encoded."""
    from common.vector_env import ChunkedVectorEnv

    config = tiny_config(tmp_path, **{"env.max_episode_steps": 12})  # 3 chunks of 4 actions: episodes end mid-rollout
    returned, step_chunk = [], ChunkedVectorEnv.step_chunk
    monkeypatch.setattr(ChunkedVectorEnv, "step_chunk", lambda env, actions: returned.append(step := step_chunk(env, actions)) or step)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, iteration=0)
    policy, rows = FlowPolicy.from_pretrained(bc_checkpoint), 4
    ended = batch.terminated | batch.truncated
    assert ended[:-1].any() and not ended[:-1].all()  # both kinds of row in this rollout
    bootstrap = ended.copy()
    bootstrap[-1] = True
    assert batch.bootstrap_at.tolist() == np.argwhere(bootstrap).tolist()
    every_next = np.stack([step.next_obs.state for step in returned[-batch.num_decisions :]])  # (T, N, obs_dim)
    np.testing.assert_array_equal(batch.bootstrap_obs.state, every_next[bootstrap])
    with torch.no_grad():
        plain = policy.value(policy.encode(Observation(every_next.reshape(-1, every_next.shape[-1])).to_torch()))
        features = policy.encode(batch.obs.flatten_leading().to_torch())
        encoded, encode = [], policy.encode
        monkeypatch.setattr(policy, "encode", lambda obs: encoded.append(obs.batch_shape[0]) or encode(obs))
        values = scoring_module.next_observation_values(policy, batch, features, rows)
    assert torch.equal(values.flatten(), plain)
    assert sum(encoded) == int(bootstrap.sum()) and max(encoded) <= rows


def test_rollouts_are_reproducible_per_iteration(setup) -> None:
    _, actor, learner = setup
    weights = learner.broadcast()
    a, b, c = actor.sample(weights, 3), actor.sample(weights, 3), actor.sample(weights, 4)
    np.testing.assert_array_equal(a.chains, b.chains)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert not np.array_equal(a.chains, c.chains)


def test_policy_left_in_train_mode_with_dropout_fails_fast(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path)
    actor = RolloutActor(config, 0, bc_checkpoint)
    batch = actor.sample(None, 0)
    # The seed report's bug: a wrapper whose eval() does not reach the dropout layers.
    policy = with_dropout(FlowPolicy.from_pretrained(bc_checkpoint), 0.2)
    learner = Learner(config, policy)
    policy.train()
    policy.eval = lambda: policy  # type: ignore[method-assign]
    before = params(policy)
    # Dropout also makes the learner's scores of the actor's chains differ from the actor's own: both diagnostics fire.
    with pytest.warns(BehaviourGapWarning, match="same precision on both sides"):
        with pytest.raises(NonDeterministicPolicyError, match=r"velocity_net\.\d+ \(Dropout, p=0\.2, train mode\)"):
            learner.update(batch)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # nothing was stepped


def optimizer_state(learner: Learner) -> dict:
    return copy.deepcopy(learner.optimizer.state_dict())


def assert_same_state(learner: Learner, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
    assert all(torch.equal(v, weights[k]) for k, v in learner.policy.state_dict().items())
    now = learner.optimizer.state_dict()
    assert now["state"].keys() == optimizer["state"].keys()
    for index, slots in optimizer["state"].items():
        assert all(torch.equal(torch.as_tensor(now["state"][index][k]), torch.as_tensor(v)) for k, v in slots.items())


def scoring_out_of_memory(monkeypatch, fails: Callable[[int], bool]) -> list[int]:
    """The learner's chain scoring raises a GPU's out-of-memory error where fails(number of chains); returns the
    numbers of chains it was asked to score."""
    asked, score = [], learner_module.chain_log_prob

    def tight_memory(policy, features, chains, *args, **kwargs):
        asked.append(len(chains))
        if fails(len(chains)):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(chains)} chains\nmore of the message")
        return score(policy, features, chains, *args, **kwargs)

    patch_chain_log_prob(monkeypatch, tight_memory)
    return asked


@pytest.mark.filterwarnings("ignore::common.diagnostics.BehaviourGapWarning")  # the second rollout is of the first weights
def test_an_update_out_of_gpu_memory_runs_again_in_smaller_micro_batches_and_keeps_them(setup, bc_checkpoint, monkeypatch) -> None:
    """learner.faults.split_on_out_of_memory: an update whose micro-batches do not fit is rolled back and made again with
    each minibatch split into twice as many, until they fit; it lands on the bits of the update configured with that
    split, which the learner keeps for the next ones."""
    config, actor, learner = setup
    batch, later = actor.sample(None, iteration=0), actor.sample(None, iteration=1)
    configured = copy.deepcopy(config)
    configured.algorithm.grad_accum = 4
    reference = Learner(configured, FlowPolicy.from_pretrained(bc_checkpoint))
    expected = [(reference.update(batch), params(reference.policy)), (reference.update(later), params(reference.policy))]

    asked = scoring_out_of_memory(monkeypatch, lambda chains: chains > 4)
    with pytest.warns(MicroBatchSplitWarning) as split:
        metrics = learner.update(batch)
    assert [str(w.message) for w in split] == [
        "iteration 0: out of GPU memory with micro-batches of 16 decisions (CUDA out of memory. Tried to allocate 16 chains); "
        "the update runs again from its start with micro-batches of <= 8 (algorithm.grad_accum 1 -> 2, kept from now on)",
        "iteration 0: out of GPU memory with micro-batches of 8 decisions (CUDA out of memory. Tried to allocate 8 chains); "
        "the update runs again from its start with micro-batches of <= 4 (algorithm.grad_accum 2 -> 4, kept from now on)",
    ]
    assert asked[:2] == [16, 8] and max(asked[2:]) == 4  # the scoring pass met the error first, each time
    assert metrics.pop("faults/grad_accum") == 4 and config.algorithm.grad_accum == 1  # the run's config is unchanged
    strip = lambda m: {k: v for k, v in m.items() if "seconds" not in k}  # noqa: E731
    for update, (expected_metrics, expected_weights) in enumerate(expected):
        if update:
            asked.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error", MicroBatchSplitWarning)  # the split is kept: no second try
                metrics = learner.update(later)
            assert max(asked) == 4 and metrics.pop("faults/grad_accum") == 4
        assert strip(metrics) == strip(expected_metrics)
        assert all(torch.equal(v, expected_weights[k]) for k, v in learner.policy.state_dict().items())


def test_micro_batches_within_a_budget_are_the_fewest_whose_largest_fits() -> None:
    for rows in (1, 7, 16, 64):
        for budget in (0.5, 10.0, 13.0, 40.0, 1000.0):
            for per_row in (0.0, 1.0, 2.5):
                fitting = [count for count in range(1, rows + 1) if 3.0 + per_row * -(-rows // count) <= budget]
                assert micro_batches_within(budget, 3.0, per_row, rows) == (fitting[0] if fitting else rows)


class MeasuredMemory:
    """A GPU allocator's readings for the learner's micro-batch sizing: `base` bytes always allocated, and a peak of
    `base` plus `per_row` bytes for each chain of the largest scoring that kept a graph for the backward pass."""

    def __init__(self, monkeypatch, base: int, per_row: int) -> None:
        self.base, self.per_row, self.rows, self.asked = base, per_row, 0, []
        score = learner_module.chain_log_prob

        def measured(policy, features, chains, *args, **kwargs):
            self.asked.append(len(chains))
            if torch.is_grad_enabled():
                self.rows = max(self.rows, len(chains))
            return score(policy, features, chains, *args, **kwargs)

        patch_chain_log_prob(monkeypatch, measured)

    def allocated(self) -> int:
        return self.base

    def peak(self) -> int:
        return self.base + self.per_row * self.rows


def test_micro_batches_sized_by_memory_fill_the_budget_from_the_first_step_that_trains_the_actor(bc_checkpoint, tmp_path, monkeypatch):
    """learner.speed.micro_batch_memory_gib: the first micro-batch of the first step sets the split of every later one, the
    fewest micro-batches within the budget; the update differs from one made with that split throughout by rounding."""
    mib = 2**20
    budget = (2048 + 9 * 100) / 1024  # GiB: 2 GiB allocated, then room for 9 decisions of 100 MiB
    config = tiny_config(tmp_path, **{"learner.num_gpus": 1, "learner.speed.micro_batch_memory_gib": budget, "algorithm.grad_accum": 4})
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, iteration=0)
    memory = MeasuredMemory(monkeypatch, base=2048 * mib, per_row=100 * mib)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint), memory=memory)
    metrics = learner.update(batch)
    # 16 decisions, one minibatch, 2 epochs: the scoring pass and the first step in micro-batches of 4; then 9 decisions
    # fit the budget, so the second step runs in 2 micro-batches of 8.
    assert memory.asked == [4] * 4 + [4] * 4 + [8, 8] and metrics["ppo/micro_batch_rows"] == 8
    assert learner.plan.grad_accum == 2 and "faults/grad_accum" not in metrics
    assert learner.cfg.grad_accum == config.algorithm.grad_accum == 4  # the plan is the learner's own: no config rewritten

    halves = tiny_config(tmp_path, **{"algorithm.grad_accum": 2})
    reference = Learner(halves, FlowPolicy.from_pretrained(bc_checkpoint))
    expected = reference.update(batch)
    for key in ("losses/pg_loss", "losses/v_loss", "losses/approx_kl"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    for name, value in learner.policy.state_dict().items():
        torch.testing.assert_close(value, reference.policy.state_dict()[name], rtol=1e-4, atol=1e-6)

    tight = tiny_config(tmp_path, **{"learner.num_gpus": 1, "learner.speed.micro_batch_memory_gib": 2.0})
    learner = Learner(tight, FlowPolicy.from_pretrained(bc_checkpoint), memory=MeasuredMemory(monkeypatch, base=2048 * mib, per_row=mib))
    with pytest.warns(MicroBatchSplitWarning, match=r"one decision alone needs about 2\.00 GiB \(2\.00 GiB allocated before"):
        assert learner.update(batch)["ppo/micro_batch_rows"] == 1
    with pytest.raises(ValueError, match="micro_batch_memory_gib reads a GPU's allocator; this learner runs on cpu"):
        Learner(tight, FlowPolicy.from_pretrained(bc_checkpoint))


@pytest.mark.parametrize("split", [True, False])
def test_an_update_that_does_not_fit_even_split_stops_with_the_weights_as_they_were(setup, monkeypatch, split) -> None:
    """Where one decision per micro-batch does not fit either (or learner.faults.split_on_out_of_memory is off), the error
    stops the update, and the weights and the optimiser are those before it: here the error comes at the second
    optimiser step, after the first has changed them."""
    config, actor, learner = setup
    learner.update(actor.sample(learner.broadcast(), 0))  # real Adam moments before the failing iteration
    batch = actor.sample(learner.broadcast(), 1)
    before, optimizer, version = params(learner.policy), optimizer_state(learner), learner.version
    learner.config.learner.faults.split_on_out_of_memory = split
    passes_with_gradients = []

    def after_the_first_step(chains: int) -> bool:
        if torch.is_grad_enabled():
            passes_with_gradients.append(chains)
        return len(passes_with_gradients) > 1

    scoring_out_of_memory(monkeypatch, after_the_first_step)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("always")
        learner.update(batch)
    splits = [w for w in caught if issubclass(w.category, MicroBatchSplitWarning)]
    assert len(splits) == (4 if split else 0) and learner.plan.grad_accum == (16 if split else 1)  # 16 -> 8 -> 4 -> 2 -> 1 rows
    assert learner.version == version and learner.iteration == 1
    assert_same_state(learner, before, optimizer)


def test_nan_reward_skips_the_update_and_names_the_rewards(setup) -> None:
    _, actor, learner = setup
    batch = actor.sample(None, 0)
    rewards = batch.rewards.copy()
    rewards[0, 0] = np.nan
    batch.rewards = rewards
    with pytest.raises(NonFiniteError, match="rewards"):
        batch.validate()
    before, optimizer = params(learner.policy), optimizer_state(learner)
    with pytest.warns(NonFiniteUpdateWarning, match=r"rewards"):
        metrics = learner.update(batch)
    assert metrics["faults/skipped_update"] == 1.0 and learner.skipped_updates == 1 and learner.version == 0
    assert_same_state(learner, before, optimizer)


def test_nan_loss_at_minibatch_2_rolls_back_weights_and_optimiser(setup, monkeypatch) -> None:
    """The first minibatch has already stepped when the NaN appears in the second (one minibatch per epoch here,
    so the second is epoch 1's): that step is undone with the rest of the iteration."""
    _, actor, learner = setup
    learner.update(actor.sample(learner.broadcast(), 0))  # the optimiser holds real Adam moments before the faulty iteration
    batch = actor.sample(learner.broadcast(), 1)
    before, optimizer, version = params(learner.policy), optimizer_state(learner), learner.version
    calls = []
    original = algorithms_module.ppo_policy_loss

    def nan_on_minibatch_2(new_log_probs, *args):
        calls.append(1)
        loss, metrics = original(new_log_probs, *args)
        return (loss * float("nan") if len(calls) == 2 else loss), metrics

    monkeypatch.setattr(algorithms_module, "ppo_policy_loss", nan_on_minibatch_2)
    with pytest.warns(NonFiniteUpdateWarning, match=r"epoch 1 minibatch 0: non-finite values \(NaN/Inf\) in \['pg_loss'\]"):
        metrics = learner.update(batch)
    assert len(calls) == 2, "the first minibatch stepped, the second met the NaN"
    assert metrics["faults/skipped_update"] == 1.0 and learner.version == version
    assert_same_state(learner, before, optimizer)


def test_nan_gradient_rolls_back_and_repeated_skips_back_the_learning_rate_off(setup, monkeypatch) -> None:
    _, actor, learner = setup
    batch = actor.sample(None, 0)
    before, optimizer = params(learner.policy), optimizer_state(learner)
    original = torch.Tensor.backward

    def poisoned_backward(self, *args, **kwargs):
        original(self, *args, **kwargs)
        next(learner.policy.velocity_net.parameters()).grad.fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "backward", poisoned_backward)
    limit = learner.config.learner.faults.nonfinite_backoff_after
    for skipped in range(1, limit + 1):
        with pytest.warns(NonFiniteUpdateWarning, match=r"non-finite gradients in \['velocity_net.0.weight'") as caught:
            learner.update(batch)
        assert learner.skipped_updates == skipped
    assert "learning rates now x0.5" in str(caught[-1].message) and learner.lr_backoff == 0.5
    assert_same_state(learner, before, optimizer)
    monkeypatch.setattr(torch.Tensor, "backward", original)
    metrics = learner.update(actor.sample(None, 1))  # a clean iteration trains again, at the backed-off rate
    assert metrics["ppo/actor_lr"] == pytest.approx(0.5 * learner.cfg.actor_lr * lr_scale(limit, learner.config.iterations, learner.cfg))
    assert learner.version == 1 and learner.nonfinite_streak == 0


def test_weights_are_checked_finite_before_publish_and_save(setup, tmp_path) -> None:
    _, _, learner = setup
    with torch.no_grad():
        next(learner.policy.velocity_net.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"before publishing: non-finite values \(NaN/Inf\) in \['velocity_net.0.weight'"):
        learner.broadcast()
    with pytest.raises(NonFiniteError, match="before saving"):
        learner.save_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_resume_reproduces_weights(setup, tmp_path, bc_checkpoint) -> None:
    config, actor, learner = setup
    batches = []
    for it in range(3):
        batches.append(actor.sample(learner.broadcast(), it))
        learner.update(batches[-1])
        if it == 0:
            learner.save_checkpoint(tmp_path / "k1")
    resumed = Learner(config, FlowPolicy.from_pretrained(tmp_path / "k1"))
    resumed.load_trainer_state(tmp_path / "k1")
    assert (resumed.iteration, resumed.version, resumed.env_steps) == (1, 1, batches[0].env_steps)  # counts on, not from 0
    fresh_actor = RolloutActor(config, 0, tmp_path / "k1")
    for it in (1, 2):
        batch = fresh_actor.sample(resumed.broadcast(), it)
        np.testing.assert_array_equal(batch.chains, batches[it].chains)
        resumed.update(batch)
    for name, tensor in learner.policy.state_dict().items():
        assert torch.equal(tensor, resumed.policy.state_dict()[name]), name
    assert resumed.env_steps == learner.env_steps == sum(b.env_steps for b in batches)


def test_lr_schedule(setup) -> None:
    config, _, _ = setup
    cfg = config.algorithm
    cfg.lr_warmup_iters, cfg.lr_final_frac = 2, 0.1
    assert lr_scale(0, 10, cfg) == 0.5 and lr_scale(1, 10, cfg) == 1.0
    assert lr_scale(2, 10, cfg) == pytest.approx(1.0) and lr_scale(10, 10, cfg) == pytest.approx(0.1)


def test_concat_keeps_actor_order(setup) -> None:
    _, actor, learner = setup
    a, b = actor.sample(None, 0), actor.sample(None, 1)
    joined = RolloutBatch.concat([a, b])
    assert joined.num_envs == 4 and joined.env_steps == a.env_steps + b.env_steps
    assert a.policy_cpu_seconds > 0 and a.env_cpu_seconds > 0  # where the sampling thread's CPU went
    assert joined.env_cpu_seconds == a.env_cpu_seconds + b.env_cpu_seconds
    assert joined.policy_cpu_seconds == a.policy_cpu_seconds + b.policy_cpu_seconds
    np.testing.assert_array_equal(joined.chains[:, 2:], b.chains)


def test_critic_warmup_leaves_the_actor_untouched(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path, **{"algorithm.critic_warmup_iters": 1})
    actor = RolloutActor(config, 0, bc_checkpoint)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    before = params(learner.policy)
    metrics = learner.update(actor.sample(None, 0))
    changed = {k for k, v in learner.policy.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("critic_net") for k in changed)
    assert metrics["ppo/actor_lr"] == 0.0
    learner.update(actor.sample(None, 1))
    assert not torch.equal(learner.policy.velocity_net[0].weight, before["velocity_net.0.weight"])


@pytest.mark.parametrize("stale_rollouts", ["decoupled", "behaviour"])
def test_a_rollout_one_version_behind_is_scored_with_its_own_weights(tmp_path, bc_checkpoint, stale_rollouts, monkeypatch) -> None:
    """actors.policy_lag=1: the learner keeps the published version the chains came from, recomputes their
    behaviour log-probs with it (equal to the actor's), leaves its current weights untouched doing so, and
    passes the ratio == 1 check against its own (proximal) weights, whichever policy the loss clips to."""
    config = tiny_config(tmp_path, **{"actors.policy_lag": 1, "algorithm.stale_rollouts": stale_rollouts})
    actor, learner = RolloutActor(config, 0, bc_checkpoint), Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    v0 = learner.broadcast()
    first, ahead = actor.sample(v0, 0), actor.sample(v0, 1)  # iteration 1 sampled while iteration 0 trains
    assert "ppo/behaviour_weight_min" not in learner.update(first)  # same version: the synchronous loss
    learner.broadcast()
    current = params(learner.policy)
    with learner.weight_versions.weights_of(learner.policy, 0, learner.version) as behaviour_policy:
        assert any(not torch.equal(v, current[k]) for k, v in behaviour_policy.state_dict().items())
    assert all(torch.equal(v, current[k]) for k, v in learner.policy.state_dict().items())  # restored exactly
    calls = []

    def spy(logp_new, logp_old, advantages, clip_eps, behaviour_weight=None):
        calls.append((logp_new.detach(), logp_old.detach(), behaviour_weight))
        return ppo_policy_loss(logp_new, logp_old, advantages, clip_eps, behaviour_weight)

    monkeypatch.setattr(algorithms_module, "ppo_policy_loss", spy)
    metrics = learner.update(ahead)
    assert ahead.weight_version == 0 and learner.version == 2
    assert metrics["logprob/behaviour_gap_max"] < 1e-5  # the learner's v0 scores match the actor's v0 scores
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert metrics["ppo/behaviour_weight_min"] < 1 < metrics["ppo/behaviour_weight_max"]  # v1 != v0 on these chains
    # What the loss clipped to, seen on its first call: the proximal weights (ratio 1 before any step) with
    # behaviour weights, or the behaviour policy (ratio already off 1, no weights).
    first_new, first_anchor, first_weight = calls[0]
    if stale_rollouts == "decoupled":
        assert (first_new - first_anchor).abs().max() <= 1e-5 and first_weight is not None
    else:
        assert (first_new - first_anchor).abs().max() > 1e-4 and first_weight is None
    learner.broadcast()
    assert sorted(learner.weight_versions.published) == [1, 2]  # only what a rollout in flight can still come from


@pytest.mark.filterwarnings("ignore::common.diagnostics.BehaviourGapWarning")  # float32 actor, bfloat16 learner
def test_a_bfloat16_learner_scores_a_lagged_rollout_with_the_weights_that_sampled_it(tmp_path, bc_checkpoint) -> None:
    """actors.policy_lag=1 under learner.speed.precision bfloat16: the behaviour log-probs of a rollout one version behind are
    what a bfloat16 learner still at that version scores, not the current weights' (autocast's kept casts of them)."""
    config = tiny_config(tmp_path, **{"actors.policy_lag": 1, "learner.speed.precision": "bfloat16"})
    actor, learner = RolloutActor(config, 0, bc_checkpoint), Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    v0 = learner.broadcast()
    first, ahead = actor.sample(v0, 0), actor.sample(v0, 1)
    learner.update(first)
    learner.broadcast()
    lagged = learner.prepare(ahead)
    at_v0 = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint)).prepare(ahead).old_log_probs
    assert (lagged.old_log_probs - at_v0).abs().max() > 1e-4  # the update moved these chains' scores
    torch.testing.assert_close(lagged.behaviour_log_probs, at_v0, rtol=0, atol=1e-6)


def test_a_rollout_further_behind_than_policy_lag_names_the_setting(setup) -> None:
    _, actor, learner = setup  # the default policy_lag 1: the learner keeps its current version and the one before
    stale = actor.sample(learner.broadcast(), 2)
    for iteration in range(2):
        learner.update(actor.sample(None, iteration))  # v0's rollouts, at most one version behind
        learner.broadcast()
    with pytest.raises(ValueError, match=r"version 0 reached the learner at version 2.*actors.policy_lag=1"):
        learner.update(stale)


def test_resume_at_policy_lag_one_samples_with_the_versions_the_uninterrupted_run_used(tmp_path, bc_checkpoint) -> None:
    """The driver's schedule at lag 1: iteration m is sampled with the version published after m - 1 updates. A
    checkpoint after 2 updates keeps version 1, which samples iteration 2, so the resumed learner hands it out again
    (in_flight_versions), scores the chains with it, and ends with the uninterrupted run's weights bit for bit."""
    config = tiny_config(tmp_path, **{"actors.policy_lag": 1})
    assert RunConfig().actors.policy_lag == 1  # the default this test is about
    actor, learner = RolloutActor(config, 0, bc_checkpoint), Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    v0 = learner.broadcast()
    assert learner.in_flight_versions() == [0, 0]  # a fresh run samples its first two iterations with the start
    batches = [actor.sample(v0, 0), actor.sample(v0, 1)]
    for iteration in range(4):
        learner.update(batches[iteration])
        published = learner.broadcast()
        if iteration == 1:
            learner.save_checkpoint(tmp_path / "k2")
        if iteration + 2 < 4:
            batches.append(actor.sample(published, iteration + 2))
    assert [b.weight_version for b in batches] == [0, 0, 1, 2]

    resumed = Learner(config, FlowPolicy.from_pretrained(tmp_path / "k2"))
    resumed.load_trainer_state(tmp_path / "k2")
    current = resumed.broadcast()
    assert resumed.in_flight_versions() == [1, 2]  # iterations 2 and 3, as the uninterrupted run sampled them
    fresh_actor = RolloutActor(config, 0, tmp_path / "k2")  # holds v2 (the checkpoint's own weights)
    again = [fresh_actor.sample(resumed.weight_versions.payload(1), 2), fresh_actor.sample(current, 3)]
    for batch, original in zip(again, batches[2:]):
        assert batch.weight_version == original.weight_version
        np.testing.assert_array_equal(batch.chains, original.chains)
        metrics = resumed.update(batch)
        resumed.broadcast()
        assert metrics["logprob/behaviour_gap_max"] < 1e-5
    for name, tensor in learner.policy.state_dict().items():
        assert torch.equal(tensor, resumed.policy.state_dict()[name]), name


def test_an_actor_loads_an_older_version_when_a_call_names_it(setup, bc_checkpoint) -> None:
    """A learner restarted from a checkpoint publishes versions the actors have moved past: each call runs with
    the weights it names, not with the newest an actor has seen."""
    config, actor, learner = setup
    v0 = learner.broadcast()
    learner.update(actor.sample(v0, 0))
    actor.load_weights(learner.broadcast())
    assert actor.version == 1
    again = actor.sample(v0, 5)
    assert actor.version == again.weight_version == 0
    np.testing.assert_array_equal(again.chains, RolloutActor(config, 0, bc_checkpoint).sample(v0, 5).chains)


def test_one_iteration_at_the_shipped_defaults(tmp_path) -> None:
    """The bare main command's config, not a tiny one: the default policy, env, rollout length and learner
    (2 minibatches of this actor's 100 decisions, 8 epochs, critic warm-up) on one default actor. Only the
    initialisation differs (random, allowed explicitly; BC would cost minutes here)."""
    import dataclasses

    from common.config import RunConfig
    from common.config_loading import load_config
    from common.policy import build_policy

    config = load_config(None, ["allow_random_init=true", f"run_dir={tmp_path / 'run'}"])
    assert dataclasses.replace(config, allow_random_init=False, run_dir=RunConfig().run_dir) == RunConfig()  # nothing else changed
    torch.manual_seed(0)
    learner = Learner(config, build_policy(config.policy))
    learner.save_checkpoint(tmp_path / "init")
    actor = RolloutActor(config, 0, tmp_path / "init")
    batch = actor.sample(learner.broadcast(), 0)
    assert batch.chains.shape == (config.actors.decisions_per_rollout, config.actors.envs_per_actor, config.policy.num_steps + 1,
                                  config.policy.chunk_size, config.policy.action_dim)  # fmt: skip
    critic_before = {k: v.clone() for k, v in learner.policy.state_dict().items() if k.startswith("critic_net")}
    metrics = learner.update(batch)
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5 and metrics["logprob/behaviour_gap_max"] < 1e-4
    assert metrics["ppo/actor_lr"] == 0.0  # critic warm-up: the default's first iteration trains the critic only
    assert metrics["ppo/epochs_run"] == config.algorithm.update_epochs
    assert any(not torch.equal(learner.policy.state_dict()[k], v) for k, v in critic_before.items())


def test_the_learners_process_imports_no_envs() -> None:
    """Ray starts the learner's worker by importing learner.runtime.learner_actor: Metaworld, MuJoCo and the rollout actors
    cost its start CPU seconds, taken from the rollout actors starting beside it (docs/performance.md)."""
    envs = {"metaworld", "mujoco", "actors.rollout_actor", "common.suites.metaworld"}
    code = f"import sys, learner.runtime.learner_actor; print(sorted({envs!r} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert imported == "[]"


def plan_config(tmp_path, **sections):
    """tiny_config with the update's minibatches counted, not sized: one actor's 16 decisions split by num_minibatches."""
    return tiny_config(tmp_path, **{"algorithm.minibatch_size": "null", "algorithm.target_kl": "null", **sections})


def test_every_decision_enters_each_epochs_loss_once(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """16 decisions in 3 minibatches (6, 5, 5), each in 2 micro-batches: the indices the loss sees over an epoch are
    all 16, once each, and the metrics say how the batch was split."""
    config = plan_config(tmp_path, **{"algorithm.num_minibatches": 3, "algorithm.grad_accum": 2, "algorithm.update_epochs": 3})
    actor, learner = RolloutActor(config, 0, bc_checkpoint), Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    seen: list[torch.Tensor] = []
    original = learner_module.minibatch_loss

    def spy(policy, features, new, data, mb_inds, *args):
        seen.append(mb_inds.clone())
        return original(policy, features, new, data, mb_inds, *args)

    monkeypatch.setattr(learner_module, "minibatch_loss", spy)
    metrics = learner.update(actor.sample(learner.broadcast(), 0))
    assert (metrics["ppo/batch_size"], metrics["ppo/num_minibatches"], metrics["ppo/minibatch_size"]) == (16, 3, 6)
    assert metrics["ppo/optimizer_steps"] == 9 and metrics["ppo/epochs_run"] == 3
    assert [len(micro) for micro in seen[:6]] == [3, 3, 3, 2, 3, 2]
    indices = torch.cat(seen)
    assert len(indices) == 3 * 16
    epochs = indices.view(3, 16)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(16))
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled every epoch


def approx_kl_per_minibatch(learner: Learner, batch: RolloutBatch, monkeypatch) -> tuple[list[float], dict[str, float]]:
    kls: list[float] = []
    original = algorithms_module.ppo_policy_loss

    def spy(*args):
        loss, metrics = original(*args)
        kls.append(float(metrics["approx_kl"]))
        return loss, metrics

    monkeypatch.setattr(algorithms_module, "ppo_policy_loss", spy)
    metrics = learner.update(batch)
    monkeypatch.setattr(algorithms_module, "ppo_policy_loss", original)
    return kls, metrics


def test_kl_early_stopping_stops_after_the_minibatch_that_exceeds_target_kl(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """The approx-KL of every minibatch of an unstopped update, then the same update with target_kl between the
    largest approx-KL before a chosen minibatch and that minibatch's own: it stops right after that minibatch's step."""
    sections = {"algorithm.num_minibatches": 4, "algorithm.update_epochs": 3}
    config = plan_config(tmp_path, **sections)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    kls, metrics = approx_kl_per_minibatch(Learner(config, FlowPolicy.from_pretrained(bc_checkpoint)), batch, monkeypatch)
    assert len(kls) == metrics["ppo/optimizer_steps"] == 12 and metrics["ppo/kl_early_stop"] == 0.0
    assert kls[0] <= 1e-10  # the first minibatch is scored with the weights of the old log-probs
    # A minibatch whose approx-KL is a new maximum, after at least one step, with minibatches of its epoch and a whole
    # epoch still to come: the latest such one.
    stop_at = max(k for k in range(1, 8) if k % 4 != 3 and kls[k] > max(kls[:k]))
    target = (max(kls[:stop_at]) + kls[stop_at]) / 2
    config = plan_config(tmp_path, **sections, **{"algorithm.target_kl": target})
    stopped_kls, stopped = approx_kl_per_minibatch(Learner(config, FlowPolicy.from_pretrained(bc_checkpoint)), batch, monkeypatch)
    assert stopped_kls == kls[: stop_at + 1]  # the same update up to there
    assert stopped["ppo/optimizer_steps"] == stop_at + 1  # that minibatch's step is taken, then no more
    assert stopped["ppo/epochs_run"] == stop_at // 4 + 1 and stopped["ppo/kl_early_stop"] == 1.0
    assert stopped["losses/approx_kl_max"] == pytest.approx(kls[stop_at])


def gradients_of_one_step(tmp_path, bc_checkpoint, batch: RolloutBatch, grad_accum: int) -> tuple[dict[str, torch.Tensor], Learner]:
    config = plan_config(tmp_path, **{"algorithm.num_minibatches": 1, "algorithm.update_epochs": 1, "algorithm.grad_accum": grad_accum})
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    grads: dict[str, torch.Tensor] = {}
    step = learner.optimizer.step

    def recording_step(*args, **kwargs):  # the gradients the step uses, after clipping
        grads.update({name: p.grad.clone() for name, p in learner.trainable_state().items() if p.grad is not None})
        return step(*args, **kwargs)

    learner.optimizer.step = recording_step
    learner.update(batch)
    return grads, learner


@pytest.mark.parametrize("grad_accum", [2, 3, 16])
def test_grad_accum_gives_the_gradient_and_weights_of_one_pass(tmp_path, bc_checkpoint, grad_accum: int) -> None:
    batch = RolloutActor(tiny_config(tmp_path), 0, bc_checkpoint).sample(None, 0)
    whole, one_pass = gradients_of_one_step(tmp_path, bc_checkpoint, batch, 1)
    split, accumulated = gradients_of_one_step(tmp_path, bc_checkpoint, batch, grad_accum)  # 3: uneven, 6 + 5 + 5
    assert whole.keys() == split.keys() and any(k.startswith("velocity_net") for k in whole) and any(k.startswith("critic") for k in whole)
    for name, grad in whole.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for name, tensor in one_pass.policy.state_dict().items():
        torch.testing.assert_close(accumulated.policy.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_recomputed_log_probs_do_not_depend_on_minibatch_size_or_order(tmp_path, bc_checkpoint) -> None:
    """The learner's old log-probs (encoded in chunks of its micro-batch) and its new ones (per shuffled minibatch)
    score each chain alike, whatever the chunking and the order."""
    config = plan_config(tmp_path)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    policy = FlowPolicy.from_pretrained(bc_checkpoint).eval()
    obs = batch.obs.flatten_leading().to_torch()
    chains = torch.as_tensor(batch.chains).flatten(0, 1)
    with torch.no_grad():
        whole = learner_module.chain_log_prob(policy, policy.encode(obs), chains).log_prob
        order = torch.randperm(len(chains), generator=torch.Generator().manual_seed(1))
        for sizes in ([16], [6, 5, 5], [1] * 16, [9, 7]):
            scored = torch.empty_like(whole)
            for idx in order.split(sizes):
                scored[idx] = learner_module.chain_log_prob(policy, policy.encode(obs.index(idx)), chains[idx]).log_prob
            torch.testing.assert_close(scored, whole, rtol=1e-6, atol=1e-6)
    for sections in (
        {"algorithm.num_minibatches": 1},
        {"algorithm.num_minibatches": 5},
        {"algorithm.minibatch_size": 4, "algorithm.grad_accum": 2},
    ):
        learner = Learner(plan_config(tmp_path, **sections), FlowPolicy.from_pretrained(bc_checkpoint))
        torch.testing.assert_close(learner.prepare(batch).old_log_probs, whole, rtol=1e-6, atol=1e-6)


def test_the_banner_states_the_updates_shape_in_one_line() -> None:
    from common.config_loading import load_config
    from learner.runtime.reporting import banner

    assert learner_module.update_shape(RunConfig()) == "1000 decisions per iteration, 2 minibatches x 500, 8 epochs"
    sixteen = load_config(None, ["actors.num_actors=16", "algorithm.num_minibatches=3", "algorithm.grad_accum=2"])
    assert (
        learner_module.update_shape(sixteen) == "1600 decisions per iteration, 3 minibatches x 533-534, 8 epochs, micro-batches of <= 267"
    )
    lines = banner(RunConfig(), None, None, {}, 1.0).splitlines()
    assert [line for line in lines if "decisions per iteration" in line] == [
        f"update             : {learner_module.update_shape(RunConfig())}"
    ]


def banner_config(config: RunConfig) -> dict:
    """The YAML block of the run banner, read back."""
    import yaml

    from learner.runtime.reporting import banner

    lines = banner(config, None, None, {}, 1.0).splitlines()
    return yaml.safe_load("\n".join(lines[3 : lines.index("-" * 78)]))


@pytest.mark.parametrize("setting", ["mlp_ppo", "mlp_grpo", "smolvla"])
def test_the_banner_shows_only_the_policy_subsection_and_algorithm_fields_that_apply(setting: str) -> None:
    from common.config_loading import load_config

    if setting == "smolvla":
        config = load_config("configs/smolvla_tiny_pick.yaml")
    else:
        config = load_config(None, ["algorithm.algo=grpo", "algorithm.group_size=2"] if setting == "mlp_grpo" else [])
    shown, everything = banner_config(config), config.to_dict()
    if setting == "smolvla":
        assert config.policy.type == "smolvla" and shown["policy"]["smolvla"] == everything["policy"]["smolvla"]
    else:
        assert config.policy.type == "mlp_flow" and not {"smolvla", "pi0"} & set(shown["policy"])
    other_backends = {"smolvla", "pi0"} - {config.policy.type}  # every backend subsection but the run's own
    grpo_only, ppo_only = {"group_size", "grpo_std_normalization"}, {"gae_lambda", "vf_coef", "critic_lr", "critic_warmup_iters"}
    hidden = set(everything["algorithm"]) - set(shown["algorithm"])
    assert hidden >= (ppo_only if setting == "mlp_grpo" else grpo_only) and not hidden & (grpo_only if setting == "mlp_grpo" else ppo_only)
    # Nothing else is left out, and what is shown is the config's own values.
    for section, values in everything.items():
        if isinstance(values, dict):
            assert {k: v for k, v in values.items() if k in shown[section]} == shown[section], section
            left_out = {"algorithm": hidden, "policy": other_backends, "env": {"gym"}}.get(section, set())  # env.gym: a gym run's
            assert set(values) - set(shown[section]) == left_out, section
        else:
            assert shown[section] == values, section
