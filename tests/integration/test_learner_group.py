"""A learner group of two ranks (Ray actors joined by gloo) against the learner alone, on the same rollouts.

The two updates differ by float rounding only: each rank sums its share of a minibatch's loss and the all-reduce adds
the two shares, where the learner alone sums every decision in one pass, and the advantages are normalised with the
mean and std accumulated in float64 across the ranks. Over one update of a few Adam steps that moves the weights by
about 1e-7 of their scale; the tests allow 1e-5 (absolute, on weights of order 1), far below what one Adam step
moves them (the learning rate, 3e-4 and up).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from actors.rollout_actor import RolloutActor
from common.config import ConfigError, RunConfig
from common.metrics import rollout_metrics
from common.policy import FlowPolicy, build_policy, write_directory_atomically
from common.trajectory import RolloutBatch
from learner.files.checkpoints import LearnerCheckpoint
from learner.group.ranks import RENDEZVOUS_PORTS, PeerRankError, free_address
from learner.runtime.learner_actor import LearnerActor
from learner.runtime.learner_group import start_learner_group
from learner.runtime.ray_runtime import ResourceRequest
from learner.runtime.startup import plan_resources
from learner.update.learner import Learner
from tests.conftest import tiny_config
from tests.helpers.vla import SMOLVLA_TINY_CONFIG, TINY_VLA_RUN, with_test_normalization

pytestmark = pytest.mark.usefixtures("local_ray")

WEIGHT_TOLERANCE = 1e-5
RANK = ResourceRequest(0.5, 0.0)  # two ranks beside the tests' 2-CPU Ray


def rollouts(config: RunConfig, checkpoint: Path, learner: Learner) -> list[RolloutBatch]:
    """One iteration's rollouts, one batch per actor, sampled with the learner's current weights."""
    batches = []
    for index in range(config.actors.num_actors):
        actor = RolloutActor(config, index, checkpoint)
        actor.load_weights(learner.broadcast())
        batches.append(actor.sample(None, iteration=0))
    return batches


def group_update(config: RunConfig, checkpoint: Path | None, iterations: list[list[RolloutBatch]], resume_dir: Path | None = None,
                 save_to: Path | None = None, demo_tasks: dict[str, int] | None = None) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """A two-rank group's metrics of each update and each rank's trainable weights after the last (gathered whole when
    sharded); each rank fetches its consecutive share of an iteration's rollouts (actors' batches) from the object store.
    The group starts from `checkpoint`, or resumes from `resume_dir`; with `save_to`, it checkpoints there at the end;
    with `demo_tasks`, every rank holds those tasks' demonstrations first (Learner.add_demonstrations)."""
    ranks = start_learner_group(config, RANK, LearnerActor, config, checkpoint and str(checkpoint), resume_dir and str(resume_dir))
    try:
        if demo_tasks:
            ray.get([rank.add_demonstrations.remote(demo_tasks) for rank in ranks.actors])
        metrics = []
        for batches in iterations:
            refs = [ray.put(batch) for batch in batches]
            shares = np.array_split(np.array(refs, dtype=object), len(ranks.actors))  # consecutive, as LearnerHandle.update
            answers = ray.get([rank.update.remote(*share) for share, rank in zip(shares, ranks.actors, strict=True)])
            assert answers[1:] == [{}] * (len(answers) - 1)  # rank 0 reports for the group
            metrics.append(answers[0])
            ray.get([rank.publish.remote() for rank in ranks.actors])
        if save_to is not None:
            ray.get([rank.save.remote(str(save_to)) for rank in ranks.actors])
        weights = ray.get([rank.__ray_call__.remote(lambda actor: actor.learner.sharding.full(actor.learner.trainable_state()))
                           for rank in ranks.actors])  # fmt: skip
        return metrics, weights
    finally:
        ranks.kill()


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="ppo"),
        # 3 actors over 2 ranks (two batches and one), minibatches of 3 decisions: a rank holds 1 decision of some
        pytest.param(
            {"actors.num_actors": 3, "actors.envs_per_actor": 1, "actors.decisions_per_rollout": 4, "algorithm.minibatch_size": 3},
            id="ppo-uneven-split",
        ),  # fmt: skip
        pytest.param({"algorithm.target_kl": 1e-6, "algorithm.update_epochs": 4}, id="ppo-kl-early-stop"),
        pytest.param(
            {
                "algorithm.algo": "grpo",
                "algorithm.group_size": 2,
                "actors.decisions_per_rollout": 10,
                "env.reward": "dense",
                "algorithm.kl_beta": 0.01,
            },
            id="grpo-kl-reference",
        ),  # fmt: skip
        pytest.param({"learner.sharding": "fsdp", "algorithm.target_kl": 1e-6, "algorithm.update_epochs": 4}, id="fsdp-kl-early-stop"),
        pytest.param(
            {
                "learner.sharding": "fsdp",
                "algorithm.algo": "grpo",
                "algorithm.group_size": 2,
                "actors.decisions_per_rollout": 10,
                "env.reward": "dense",
                "algorithm.kl_beta": 0.01,
            },
            id="fsdp-grpo-kl-reference",
        ),  # fmt: skip
    ],
)
def test_two_ranks_make_the_one_rank_update_on_the_same_rollouts(tmp_path, bc_checkpoint, fields) -> None:
    config = tiny_config(tmp_path, **{"learner.num_learners": 2, **fields})
    alone = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    iterations, expected = [], []
    for _ in range(2):  # the second update also checks the optimiser's state and the published versions
        iterations.append(rollouts(config, bc_checkpoint, alone))
        batch, version = RolloutBatch.concat(iterations[-1]), alone.version
        expected.append({**alone.update(batch), **rollout_metrics(batch, version)})
    metrics, weights = group_update(config, bc_checkpoint, iterations)

    for rank_weights in weights[1:]:  # the ranks stay identical: the same summed gradients, the same Adam steps
        assert all(torch.equal(rank_weights[name], weights[0][name]) for name in weights[0])
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)
    moved = max((tensor - FlowPolicy.from_pretrained(bc_checkpoint).state_dict()[name]).abs().max().item()
                for name, tensor in alone.trainable_state().items())  # fmt: skip
    assert moved > 20 * WEIGHT_TOLERANCE  # the tolerance is far below what the updates did
    for group, one in zip(metrics, expected, strict=True):
        # The ratio check holds on every rank: old and new log-probs of a chain differ by a rounding at most (a rank
        # scores its rows in other batch shapes than the learner alone, so its kernels may round differently).
        assert one["ppo/first_minibatch_ratio_dev"] <= 1e-6 and group["ppo/first_minibatch_ratio_dev"] <= 1e-6
        for key in ("ppo/optimizer_steps", "ppo/epochs_run", "ppo/kl_early_stop", "ppo/batch_size", "rollout/env_steps",
                    "rollout/episodes", "rollout/decisions"):  # fmt: skip
            assert group[key] == one[key], key
        for key in ("losses/approx_kl", "losses/clipfrac", "logprob/old_mean", "rollout/success_rate", "rollout/reward_per_decision"):
            assert group[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7, nan_ok=True), key
        # The policy loss is a mean of terms of order 1 (normalised advantages times ratios near 1) that cancel to about
        # 1e-3: the terms' float32 rounding, not the mean's size, sets how far the two may lie apart.
        assert group["losses/pg_loss"] == pytest.approx(one["losses/pg_loss"], rel=0, abs=1e-6)
        if "losses/explained_variance" in one:  # over each minibatch's decisions, however the ranks split them
            assert group["losses/explained_variance"] == pytest.approx(one["losses/explained_variance"], rel=1e-4, abs=1e-5)
        if "values/advantage_raw_std" in one:  # PPO's: over every rank's decisions, not the mean of the ranks' stds
            assert group["values/advantage_raw_std"] == pytest.approx(one["values/advantage_raw_std"], rel=1e-5)
    if "algorithm.target_kl" in fields:  # stopped early, at the same step
        assert metrics[0]["ppo/kl_early_stop"] == 1.0 and metrics[0]["ppo/optimizer_steps"] < 4 * 2
    if fields.get("algorithm.algo") == "grpo":  # each rank holds whole groups; their counts add up
        assert [m["grpo/groups"] for m in metrics] == [m["grpo/groups"] for m in expected] == [2.0, 2.0]
    # What the rank that holds the most holds: the whole policy, its gradients and Adam state, or about half of each.
    share = 0.5 if fields.get("learner.sharding") == "fsdp" else 1.0
    for name, held in alone.state_bytes().items():
        assert metrics[-1][f"memory/rank_{name}"] == pytest.approx(share * held, rel=0.05), name


TWO_TASK_RUN = {"env.task": "reach-v3,pick-place-v3", "policy.obs_dim": 41, "learner.num_learners": 2, "allow_random_init": True,
                "actors.envs_per_actor": 4, "env.reward": "shaped"}  # fmt: skip


def two_task_checkpoint(config: RunConfig, directory: Path) -> Path:
    """A seeded random two-task policy with unit normalisation, saved."""
    torch.manual_seed(0)
    policy = build_policy(config.policy)
    policy.set_normalization(torch.zeros(41), torch.ones(41), torch.zeros(4), torch.ones(4))
    return write_directory_atomically(directory, policy.save_pretrained)


def test_each_tasks_advantages_are_normalised_on_their_own_and_two_ranks_do_the_same(tmp_path) -> None:
    """algorithm.normalize_advantages_per_task on a two-task run: the learner alone gives each task's decisions zero mean
    and unit std (checked against the raw advantages normalised here, task by task), reports each task's raw std, and
    a two-rank group, each rank holding one actor's envs, makes the same update, the same per-task stds and each task's
    other figures."""
    config = tiny_config(tmp_path, **TWO_TASK_RUN, **{"algorithm.normalize_advantages_per_task": True})
    checkpoint = two_task_checkpoint(config, tmp_path / "checkpoint")

    def learner(run: RunConfig) -> Learner:
        torch.manual_seed(1)  # the same critic for both
        return Learner(run, FlowPolicy.from_pretrained(checkpoint))

    alone = learner(config)
    batches = rollouts(config, checkpoint, alone)
    batch = RolloutBatch.concat(batches)
    raw = learner(dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, normalize_advantages=False)))
    raw_advantages = raw.prepare(batch).advantages.numpy()
    normalised = alone.prepare(batch).advantages.numpy()
    env_task = np.tile(np.array(batch.env_tasks), batch.num_decisions)[batch.valid.flatten()]
    assert sorted(set(env_task)) == ["pick-place-v3", "reach-v3"]
    for task in ("reach-v3", "pick-place-v3"):
        mine = raw_advantages[env_task == task]
        np.testing.assert_allclose(normalised[env_task == task], (mine - mine.mean()) / (mine.std(ddof=1) + 1e-8), rtol=1e-4, atol=1e-5)
    expected = alone.update(batch)
    metrics, weights = group_update(config, checkpoint, [batches])
    for task in ("reach-v3", "pick-place-v3"):
        key = f"values/task/{task}/advantage_raw_std"
        assert expected[key] == pytest.approx(raw_advantages[env_task == task].std(ddof=1), rel=1e-5)
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-5)
    task_figures = [key for key in expected if key.startswith(("policy/task/", "values/task/"))]
    assert len(task_figures) == 2 * 6  # each task's own figures (learner.update.task_figures), pooled over the ranks
    for key in task_figures:
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)


def test_a_sharded_group_adds_a_stalled_tasks_demonstrations_as_the_learner_alone_does(tmp_path) -> None:
    """Demonstrations of pick-place in a two-rank sharded group's update: every rank draws the same batch and
    backpropagates its half, so the weights and the demonstrations' loss are the learner alone's."""
    fields = {"learner.sharding": "fsdp", "algorithm.stall_demos": 2, "algorithm.stall_bc_batch": 16, "algorithm.stall_bc_coef": 2.0,
              "env.max_episode_steps": 40}  # fmt: skip
    config = tiny_config(tmp_path, **TWO_TASK_RUN, **fields)
    checkpoint = two_task_checkpoint(config, tmp_path / "checkpoint")
    torch.manual_seed(1)
    alone = Learner(config, FlowPolicy.from_pretrained(checkpoint))
    alone.add_demonstrations({"pick-place-v3": 0})
    batches = rollouts(config, checkpoint, alone)
    expected = alone.update(RolloutBatch.concat(batches))
    torch.manual_seed(1)
    metrics, weights = group_update(config, checkpoint, [batches], demo_tasks={"pick-place-v3": 0})
    assert metrics[0]["losses/demo_bc_loss"] == pytest.approx(expected["losses/demo_bc_loss"], rel=1e-5)
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)


def test_a_sharded_group_checkpoints_as_the_learner_alone_and_resumes_from_its_checkpoint(tmp_path, bc_checkpoint) -> None:
    """Rank 0 writes the policy and the Adam state gathered from the shards: what the learner alone writes after the same
    update. A sharded group that resumes from the learner alone's checkpoint takes its shard of that state and makes the
    learner alone's next update."""
    config = tiny_config(tmp_path, **{"learner.num_learners": 2, "learner.sharding": "fsdp"})
    alone = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    first = rollouts(config, bc_checkpoint, alone)
    alone.update(RolloutBatch.concat(first))
    saved = alone.save_checkpoint(tmp_path / "alone")
    second = rollouts(config, bc_checkpoint, alone)
    alone.update(RolloutBatch.concat(second))

    group_update(config, bc_checkpoint, [first], save_to=tmp_path / "group")
    written, expected = LearnerCheckpoint(tmp_path / "group"), LearnerCheckpoint(saved)
    group_state, alone_state = written.trainer_state(), expected.trainer_state()
    assert (group_state.iteration, group_state.version, group_state.env_steps) == (alone_state.iteration, alone_state.version,
                                                                                   alone_state.env_steps)  # fmt: skip
    group_policy, alone_policy = FlowPolicy.from_pretrained(written.directory).state_dict(), FlowPolicy.from_pretrained(saved).state_dict()
    for name, tensor in alone_policy.items():
        torch.testing.assert_close(group_policy[name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)
    assert group_state.optimizer["state"].keys() == alone_state.optimizer["state"].keys()
    for index, moments in alone_state.optimizer["state"].items():
        for key, tensor in moments.items():  # Adam's moments whole, in the learner alone's layout
            torch.testing.assert_close(group_state.optimizer["state"][index][key], tensor, rtol=1e-4, atol=1e-9)

    _, weights = group_update(config, None, [second], resume_dir=saved)
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)


def test_a_sharded_rank_left_without_a_decision_runs_in_step_with_the_others(tmp_path, bc_checkpoint) -> None:
    """Every env of rank 1's actor broke its episodes (no valid decision): rank 1 keeps none for the loss, yet runs each
    minibatch's passes in step with rank 0 (zero-weight ones over a row it holds, as FSDP's gathers need every rank),
    and the update is the learner alone's on the same rollouts."""
    config = tiny_config(tmp_path, **{"learner.num_learners": 2, "learner.sharding": "fsdp", "actors.policy_lag": 0})
    alone = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    batches = rollouts(config, bc_checkpoint, alone)
    batches[1] = dataclasses.replace(batches[1], valid=np.zeros_like(batches[1].valid))
    expected = alone.update(RolloutBatch.concat(batches))
    metrics, weights = group_update(config, bc_checkpoint, [batches])
    assert metrics[0]["ppo/batch_size"] == expected["ppo/batch_size"] == batches[0].valid.size
    assert metrics[0]["ppo/optimizer_steps"] == expected["ppo/optimizer_steps"]
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)


def test_the_rendezvous_port_is_free_and_drawn_below_the_ephemeral_ports(monkeypatch) -> None:
    """free_address: a port that rank 0 can bind, drawn outside the range the kernel hands out to every connection (and
    above Ray's worker ports); where none of its draws is free, one the kernel picks."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {int(free_address("127.0.0.1").rsplit(":", 1)[1]) for _ in range(20)}
    assert all(RENDEZVOUS_PORTS[0] <= port < min(RENDEZVOUS_PORTS[1], low) for port in ports) and len(ports) > 1
    port = ports.pop()
    with socket.socket() as taken:  # the range holds one port, and another process holds it
        taken.bind(("127.0.0.1", port))
        monkeypatch.setattr("learner.group.ranks.RENDEZVOUS_PORTS", (port, port + 1))
        address = free_address("127.0.0.1", tries=3)
    assert address.startswith("tcp://127.0.0.1:") and int(address.rsplit(":", 1)[1]) != port
    with socket.socket() as rank_zero:
        rank_zero.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))


def test_a_group_the_cluster_cannot_hold_is_refused_in_one_line_naming_what_is_missing(tmp_path) -> None:
    gpus = tiny_config(tmp_path, **{"learner.num_learners": 2, "learner.num_gpus": 1})
    named = r"learner asks for \{'GPU': 2\.0\} \(learner\.num_gpus / learner\.resources, times learner\.num_learners=2 ranks\)"
    with pytest.raises(ConfigError, match=named) as error:
        plan_resources(gpus)
    assert "\n" not in str(error.value)
    slots = tiny_config(tmp_path, **{"learner.num_learners": 2, "learner.resources": {"learner_slot": 1}})
    with pytest.raises(ConfigError, match=r"\{'learner_slot': 2\.0\} \(.*times learner\.num_learners=2 ranks\)"):
        plan_resources(slots)
    with pytest.raises(ConfigError, match=r"learner\.num_learners \(3\) exceeds actors\.num_actors \(2\)"):
        tiny_config(tmp_path, **{"learner.num_learners": 3})


@pytest.fixture(scope="module")
def smolvla_checkpoint(tmp_path_factory) -> Path:
    """The tiny SmolVLA of configs/smolvla_tiny_pick.yaml with seeded weights, saved as a checkpoint (no BC: the update is
    what is compared)."""
    config = tiny_config(tmp_path_factory.mktemp("cfg"), SMOLVLA_TINY_CONFIG, **TINY_VLA_RUN)
    torch.manual_seed(0)
    policy = with_test_normalization(build_policy(config.policy))
    return write_directory_atomically(tmp_path_factory.mktemp("smolvla") / "checkpoint", policy.save_pretrained)


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_two_ranks_make_the_one_rank_update_of_the_tiny_smolvla(tmp_path, smolvla_checkpoint, sharding) -> None:
    """The VLA path: frames and instruction tokens in the rollouts, the frozen VLM's prefix encoded once per iteration and
    each rank's rows of it reused in every minibatch; sharded, the frozen VLM is split over the ranks as well."""
    fields = {**TINY_VLA_RUN, "actors.envs_per_actor": 2, "algorithm.update_epochs": 2, "algorithm.critic_warmup_iters": 0,
              "learner.num_learners": 2, "learner.sharding": sharding}  # fmt: skip
    config = tiny_config(tmp_path, SMOLVLA_TINY_CONFIG, **fields)
    alone = Learner(config, FlowPolicy.from_pretrained(smolvla_checkpoint))
    assert not alone.policy.encoder_is_trainable  # so the prefix features are cached and indexed by each rank's rows
    iterations, expected = [], []
    for _ in range(2):
        iterations.append(rollouts(config, smolvla_checkpoint, alone))
        expected.append(alone.update(RolloutBatch.concat(iterations[-1])))
    metrics, weights = group_update(config, smolvla_checkpoint, iterations)
    assert all(torch.equal(weights[1][name], weights[0][name]) for name in weights[0])
    start = FlowPolicy.from_pretrained(smolvla_checkpoint).state_dict()
    assert max((tensor - start[name]).abs().max().item() for name, tensor in alone.trainable_state().items()) > 20 * WEIGHT_TOLERANCE
    for name, tensor in alone.trainable_state().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0.0, atol=WEIGHT_TOLERANCE)
    for group, one in zip(metrics, expected, strict=True):
        assert group["ppo/first_minibatch_ratio_dev"] <= 1e-6 and one["ppo/first_minibatch_ratio_dev"] <= 1e-6
        assert (group["ppo/optimizer_steps"], group["ppo/batch_size"]) == (one["ppo/optimizer_steps"], one["ppo/batch_size"]) == (8, 16)
        # Normalised advantages average to 0, so the policy loss is a small difference of unit-sized terms: their
        # rounding (1e-7) shows at 1e-6 of it.
        assert group["losses/pg_loss"] == pytest.approx(one["losses/pg_loss"], abs=1e-6)
    share = 0.5 if sharding == "fsdp" else 1.0
    for name, held in alone.state_bytes().items():
        assert metrics[-1][f"memory/rank_{name}"] == pytest.approx(share * held, rel=0.05), name


def test_a_share_one_rank_refuses_is_raised_on_every_rank_without_waiting(tmp_path, bc_checkpoint) -> None:
    """Rank 1's rollouts of two lengths cannot be joined: it raises its own error, rank 0 a PeerRankError naming it, both
    at once (rank 0 waits for no collective that rank 1 never reaches)."""
    config = tiny_config(tmp_path, **{"learner.num_learners": 2})
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    full = rollouts(config, bc_checkpoint, learner)
    short = rollouts(tiny_config(tmp_path, **{"actors.decisions_per_rollout": 4}), bc_checkpoint, learner)[0]
    ranks = start_learner_group(config, RANK, LearnerActor, config, str(bc_checkpoint), None)
    try:
        calls = [ranks.actors[0].update.remote(full[0]), ranks.actors[1].update.remote(full[1], short)]
        with pytest.raises(PeerRankError, match="learner.update: learner rank 1 failed"):
            ray.get(calls[0], timeout=60)
        with pytest.raises(ValueError, match="rollouts have different lengths"):
            ray.get(calls[1], timeout=60)
    finally:
        ranks.kill()
