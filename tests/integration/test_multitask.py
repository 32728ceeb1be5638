"""Multi-task runs in one process: a state policy reads the task's one-hot, BC learns every task, an actor rolls out
and evaluates each task, and a multi-task policy replays one of its tasks."""

from __future__ import annotations

import copy
import dataclasses
import weakref

import numpy as np
import pytest
import torch
from torch import Tensor

from actors.rollout_actor import RolloutActor
from common.config import ConfigError, EnvConfig
from common.diagnostics import BehaviourGapWarning
from common.metrics import eval_metrics, rollout_metrics
from common.policy import FlowPolicy, build_policy
from common.rollout import close_and_free
from common.suites import Layout, make_suite
from common.suites.metaworld import MetaworldSuite, MetaworldTaskEnv
from common.trajectory import RolloutBatch
from learner.bc.training import demonstrations, expert_demonstrations, flow_matching_loss, pretrain
from learner.runtime.startup import preflight
from learner.update.learner import Learner
from tests.conftest import tiny_config

TWO_TASKS = "reach-v3,pick-place-v3"


def two_task_config(tmp_path, **sections):
    return tiny_config(tmp_path, **{"env.task": TWO_TASKS, "policy.obs_dim": 41, **sections})


@pytest.fixture(scope="module")
def two_task_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("bc2") / "checkpoint"
    report = pretrain(two_task_config(tmp_path_factory.mktemp("cfg"), **{"pretrain.eval_episodes": 4}), out, progress=False)
    return out, report


def test_the_state_ends_in_the_tasks_one_hot_and_the_rest_is_the_tasks_own() -> None:
    single, multi = make_suite(EnvConfig(task="pick-place-v3")), make_suite(EnvConfig(task=TWO_TASKS))
    layout = Layout("pick-place-v3", 2, 7)
    own, _ = single.make_env("pick-place-v3", layout=layout).reset(options={"layout": layout})
    env = multi.make_env("pick-place-v3", layout=layout)
    state, _ = env.reset(options={"layout": layout})
    np.testing.assert_array_equal(state, np.concatenate([own, [0.0, 1.0]]).astype(np.float32))
    after, *_ = env.step(np.zeros(4, np.float32))
    np.testing.assert_array_equal(after[-2:], [0.0, 1.0])
    assert env.observation_space.shape == (41,) and env.observation_space.contains(after)
    with pytest.raises(ValueError, match="a layout of reach-v3 given to an env of pick-place-v3"):
        env.reset(options={"layout": Layout("reach-v3", 2, 0)})


def test_bc_learns_every_task_and_reports_each(two_task_checkpoint) -> None:
    _, report = two_task_checkpoint
    assert report["demos"] == 2 * 2  # pretrain.num_demos of each task
    assert report["demos_per_task"] == {"reach-v3": 2, "pick-place-v3": 2}
    assert set(report["per_task"]) == {"reach-v3", "pick-place-v3"} and report["eval_episodes"] == 2 * 4
    assert report["eval_layouts"] == "reach-v3,pick-place-v3 benchmark seeds [1, 6], first 4 of each of 2 tasks"
    for rate, low, high in report["per_task"].values():
        assert low <= rate <= high
    assert report["eval_success_rate"] == pytest.approx(np.mean([rate for rate, _, _ in report["per_task"].values()]))


def test_task_demos_sets_a_tasks_demonstrations_and_a_task_outside_the_run_is_refused(tmp_path) -> None:
    config = two_task_config(tmp_path, **{"pretrain.num_demos": 1, "pretrain.task_demos": "{pick-place-v3: 3}"})
    _, chunks, episodes = demonstrations(config, make_suite(config.env), build_policy(config.policy), [])
    assert [(e.layout.task, e.layout.index) for e in episodes] == [("reach-v3", 0)] + [("pick-place-v3", i) for i in range(3)]
    assert len(chunks) == sum(len(e.actions) for e in episodes)
    stranger = two_task_config(tmp_path, **{"pretrain.task_demos": "{push-v3: 2}"})
    with pytest.raises(ConfigError, match=r"pretrain\.task_demos names \['push-v3'\], not among the run's tasks"):
        preflight(stranger, address=None, resume=False)


def test_envs_an_actor_drops_are_freed_at_once() -> None:
    # An actor of a many-task run builds and drops each task's evaluation envs in turn; envs left to Python's
    # occasional cycle collection would pile up (gigabytes over MT10's ten tasks).
    envs = [MetaworldTaskEnv("push-v3") for _ in range(2)]
    envs[0].reset()
    envs[0].step(np.zeros(4, dtype=np.float32))
    refs = [weakref.ref(env._env) for env in envs]  # Metaworld's env, which sits in the cycles
    close_and_free(envs)
    assert envs == [] and [ref() for ref in refs] == [None, None]


def test_an_actor_rolls_out_and_evaluates_both_tasks(tmp_path, two_task_checkpoint) -> None:
    checkpoint, _ = two_task_checkpoint
    config = two_task_config(tmp_path, **{"env.max_episode_steps": 16})  # every env ends episodes within the 32-step rollout
    actor = RolloutActor(config, 0, checkpoint)
    assert [env.task for env in actor.vec_env.envs] == ["reach-v3", "pick-place-v3"]
    learner = Learner(config, FlowPolicy.from_pretrained(checkpoint))
    actor.load_weights(learner.broadcast())
    batch = actor.sample(None, iteration=0)
    np.testing.assert_array_equal(batch.obs.state[:, :, -2:], np.broadcast_to([[1.0, 0.0], [0.0, 1.0]], batch.obs.state[:, :, -2:].shape))
    ended = (batch.terminated | batch.truncated).sum(axis=0)  # episodes each env ended: env 0 runs reach, env 1 pick-place
    assert sorted(batch.episode_tasks) == sorted(["reach-v3"] * ended[0] + ["pick-place-v3"] * ended[1]) and ended.min() > 0
    rollout = rollout_metrics(batch, learner_version=0)
    env_task = ["reach-v3", "pick-place-v3"]
    per_task = {task: (rollout[f"rollout/task/{task}/episodes"], rollout[f"rollout/task/{task}/success_rate"]) for task in env_task}
    assert [count for count, _ in per_task.values()] == list(ended)
    assert sum(count * rate for count, rate in per_task.values()) / sum(ended) == pytest.approx(rollout["rollout/success_rate"])
    # Each env's first episode of the rollout is flagged, and only it: with 16-step episodes both envs end one.
    first_of_env = [batch.episode_tasks.index(task) for task in env_task]
    assert np.flatnonzero(batch.episode_first).tolist() == sorted(first_of_env)
    for task in env_task:
        first_success = batch.episode_successes[batch.episode_tasks.index(task)]
        assert rollout[f"rollout/task/{task}/first_episode_success_rate"] == float(first_success)
        assert rollout[f"rollout/task/{task}/first_episode_return"] == float(batch.episode_returns[batch.episode_tasks.index(task)])
    assert rollout["rollout/first_episode_success_rate"] == np.mean(batch.episode_successes[sorted(first_of_env)])
    metrics = learner.update(batch)
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5 and metrics["logprob/behaviour_gap_max"] < 1e-4

    held_out = make_suite(config.env).held_out(3)
    version, successes = actor.evaluate(None, held_out)
    assert len(successes) == 6 and actor._eval_envs[0] == "pick-place-v3"  # only the last task's envs are kept
    positions = [i for i, layout in enumerate(held_out) if layout.task == "reach-v3"]
    rebuilt = actor.evaluate(None, [held_out[i] for i in positions])[1]
    reused = actor.evaluate(None, [held_out[i] for i in positions])[1]
    np.testing.assert_array_equal(rebuilt, successes[positions])
    np.testing.assert_array_equal(reused, successes[positions])
    metrics = eval_metrics(successes, held_out)
    assert metrics["eval/task/reach-v3/episodes"] == 3 and metrics["eval/task/pick-place-v3/episodes"] == 3
    assert metrics["eval/success_rate"] == pytest.approx(np.mean(successes))
    recordings = actor.record_episodes(None, held_out, 32, positions=[1, 4])
    assert [(r.task, r.layout) for r in recordings] == [(held_out[1].task, held_out[1]), (held_out[4].task, held_out[4])]
    assert [r.success for r in recordings] == [successes[1], successes[4]]
    actor.close()


def test_an_actor_builds_the_envs_the_task_weights_deal_it(tmp_path, two_task_checkpoint) -> None:
    checkpoint, _ = two_task_checkpoint
    config = two_task_config(tmp_path, **{"actors.num_actors": 1, "actors.envs_per_actor": 4, "env.task_weights": {"reach-v3": 0.25}})
    actor = RolloutActor(config, 0, checkpoint)
    assert [env.task for env in actor.vec_env.envs] == ["pick-place-v3", "reach-v3", "pick-place-v3", "pick-place-v3"]
    actor.close()


def test_one_task_of_a_multi_task_policy_replays_with_its_task_input(tmp_path, two_task_checkpoint, capsys) -> None:
    from learner.replay import main as replay

    checkpoint, _ = two_task_checkpoint
    out = tmp_path / "videos"
    assert replay([str(checkpoint), "--task", "pick-place-v3", "--episodes", "1", "--size", "32", "--out", str(out)]) == 0
    assert [path.name.split("_")[0] for path in out.iterdir()] == ["pick-place-v3"]
    assert replay([str(checkpoint), "--task", "push-v3", "--out", str(out)]) == 2
    assert "--task push-v3 is not one of the multi-task policy's tasks ['reach-v3', 'pick-place-v3']" in capsys.readouterr().err


def test_each_tasks_clip_share_and_kl_are_those_of_the_updates_last_step(tmp_path, two_task_checkpoint) -> None:
    """Two epochs of one minibatch: the last step draws every decision with the weights one step made. A learner that
    makes that one step alone, rescoring the chains after it, gives each task's ratios; their clipped share and k3
    mean, and each task's explained variance and action scale, are what the two-epoch update reports per task."""
    checkpoint, _ = two_task_checkpoint
    fields = {"algorithm.minibatch_size": None, "algorithm.num_minibatches": 1, "algorithm.clip_eps": 0.01, "algorithm.actor_lr": 3e-3,
              "actors.num_actors": 1}  # fmt: skip
    config = two_task_config(tmp_path, **fields, **{"algorithm.update_epochs": 2})
    one_step = two_task_config(tmp_path, **fields, **{"algorithm.update_epochs": 1})

    def learner(run) -> Learner:
        torch.manual_seed(1)  # the same critic for all three
        return Learner(run, FlowPolicy.from_pretrained(checkpoint))

    start = learner(config)
    actor = RolloutActor(config, 0, checkpoint)
    actor.load_weights(start.broadcast())
    batch = actor.sample(None, iteration=0)
    actor.close()
    before = start.prepare(batch)
    stepped = learner(one_step)
    stepped.update(batch)
    with pytest.warns(BehaviourGapWarning):  # scored with the stepped weights, which did not sample the chains
        after = stepped.prepare(dataclasses.replace(batch, weight_version=-1))
    logratio = (after.old_log_probs - before.old_log_probs).double().numpy()
    metrics = learner(config).update(batch)

    env_task = np.tile(np.array(batch.env_tasks), batch.num_decisions)[batch.valid.flatten()]
    returns, values = before.returns.double().numpy(), before.old_values.double().numpy()
    actions = before.chains[:, -1].abs().flatten(1).mean(1).numpy()
    for task in TWO_TASKS.split(","):
        mine = env_task == task
        clipped = np.abs(np.exp(logratio[mine]) - 1.0) > 0.01
        assert metrics[f"policy/task/{task}/clip_share"] == pytest.approx(clipped.mean(), abs=1e-9)
        assert metrics[f"policy/task/{task}/approx_kl"] == pytest.approx(np.mean(np.expm1(logratio[mine]) - logratio[mine]), rel=1e-3)
        residual = returns[mine] - values[mine]
        explained = 1.0 - residual.var(ddof=1) / returns[mine].var(ddof=1)
        assert metrics[f"values/task/{task}/explained_variance"] == pytest.approx(explained, rel=1e-4, abs=1e-6)
        assert metrics[f"policy/task/{task}/action_abs_mean"] == pytest.approx(actions[mine].mean(), rel=1e-5)
        assert metrics[f"policy/task/{task}/sigma_mean"] > 0
    assert any(0 < metrics[f"policy/task/{task}/clip_share"] < 1 for task in TWO_TASKS.split(","))


def recorded_gradients(learner: Learner) -> list[list[Tensor]]:
    """The actor's gradients at each of `learner`'s optimiser steps from now on, as the step takes them."""
    steps, step = [], learner.optimizer.step

    def recording(*args, **kwargs):
        steps.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in learner.actor_params])
        return step(*args, **kwargs)

    learner.optimizer.step = recording
    return steps


def test_a_stalled_tasks_demonstrations_add_their_flow_matching_gradient_from_their_iteration_on(tmp_path, two_task_checkpoint) -> None:
    """Demonstrations of pick-place handed to the learner from update 1: update 0 is the plain learner's, bit for bit;
    update 1's step takes the plain gradient plus stall_bc_coef times the flow-matching gradient of the batch of
    pick-place's scripted steps (expert_demonstrations, as BC collects them) drawn with that update's seed, computed
    here apart; a checkpoint keeps the demonstrations and the update they count from, so the learner it resumes
    makes the same next update."""
    checkpoint, _ = two_task_checkpoint
    fields = {"algorithm.stall_demos": 2, "algorithm.stall_bc_coef": 0.5, "algorithm.stall_bc_batch": 16, "algorithm.update_epochs": 1,
              "algorithm.minibatch_size": None, "algorithm.num_minibatches": 1, "algorithm.max_grad_norm": 1e9,
              "actors.num_actors": 1}  # fmt: skip
    config = two_task_config(tmp_path, **fields)

    def learner() -> Learner:
        torch.manual_seed(1)  # the same critic for every one
        return Learner(config, FlowPolicy.from_pretrained(checkpoint))

    plain, helped = learner(), learner()
    assert helped.add_demonstrations({"pick-place-v3": 1}) == ["pick-place-v3"]
    assert helped.add_demonstrations({"pick-place-v3": 0}) == [] and helped.demonstrations.from_iteration == {"pick-place-v3": 1}
    obs, chunks, episodes = expert_demonstrations(config, make_suite(config.env), plain.policy, [], {"pick-place-v3": 2})
    assert len(episodes) == 2 and torch.equal(helped.demonstrations.chunks, chunks)
    actor = RolloutActor(config, 0, checkpoint)

    def rollout(iteration: int, *learners: Learner) -> RolloutBatch:
        """A rollout of the learners' current weights (the same in each), every learner keeping the version."""
        payloads = [one.broadcast() for one in learners]
        actor.load_weights(payloads[0])
        return actor.sample(None, iteration=iteration)

    batch = rollout(0, plain, helped)
    first = helped.update(batch)
    assert "losses/demo_bc_loss" not in first and first["losses/pg_loss"] == plain.update(batch)["losses/pg_loss"]
    assert all(torch.equal(p, q) for p, q in zip(helped.actor_params, plain.actor_params, strict=True))

    weights_before = copy.deepcopy(helped.policy)
    plain_steps, helped_steps = recorded_gradients(plain), recorded_gradients(helped)
    batch = rollout(1, plain, helped)
    plain.update(batch)
    second = helped.update(batch)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + 1)
    picked = torch.randint(len(chunks), (16,), generator=generator)
    loss = flow_matching_loss(weights_before, obs.index(picked).to_torch(weights_before.obs_device), chunks[picked], generator)
    loss.backward()
    assert second["losses/demo_bc_loss"] == pytest.approx(loss.item(), rel=1e-6)
    flow = [torch.zeros_like(p) if p.grad is None else p.grad for n, p in weights_before.named_parameters()
            if n not in set(weights_before.critic_parameter_names()) and p.requires_grad]  # fmt: skip
    assert any(g.abs().max() > 0 for g in flow)
    for total, ppo, term in zip(helped_steps[0], plain_steps[0], flow, strict=True):
        torch.testing.assert_close(total, ppo + 0.5 * term, rtol=1e-5, atol=1e-7)

    saved = helped.save_checkpoint(tmp_path / "saved")
    resumed = Learner(config, FlowPolicy.from_pretrained(saved))
    resumed.load_trainer_state(saved)
    assert resumed.demonstrations.from_iteration == {"pick-place-v3": 1}
    batch = rollout(2, helped, resumed)
    actor.close()
    helped.update(batch)
    resumed.update(batch)
    assert all(torch.equal(p, q) for p, q in zip(helped.trainable_state().values(), resumed.trainable_state().values(), strict=True))


def test_stall_demonstrations_need_a_stall_window_and_an_expert_for_every_task(tmp_path, monkeypatch) -> None:
    """algorithm.stall_demos without the stall window that names the tasks is refused by the config; on a task the suite
    has no scripted expert for, before the run starts."""
    with pytest.raises(ConfigError, match="algorithm.stall_demos acts on the tasks stall_window names"):
        two_task_config(tmp_path, **{"algorithm.stall_demos": 3, "stall_window": 0})
    config = two_task_config(tmp_path, **{"algorithm.stall_demos": 3})
    preflight(config, None, False)  # Metaworld has an expert for both
    expert = MetaworldSuite.expert
    monkeypatch.setattr(MetaworldSuite, "expert", lambda suite, task: None if task == "reach-v3" else expert(suite, task))
    with pytest.raises(ConfigError, match=r"no scripted expert for \['reach-v3'\]: set algorithm.stall_demos: 0"):
        preflight(config, None, False)
