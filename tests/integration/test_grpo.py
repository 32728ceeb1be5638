"""GRPO in one process: the learner's update with its frozen reference over group rollouts of the rollout actor, the
reference kept by checkpoints, a SmolVLA reference that copies only what trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from actors.rollout_actor import RolloutActor
from common.flow import chain_log_prob, num_log_prob_elements, sample_chain
from common.policy import CheckpointError, FlowPolicy
from common.rl import kl_to_reference
from learner.files.checkpoints import REFERENCE_DIR
from learner.update.learner import Learner, frozen_reference
from tests.conftest import tiny_config
from tests.helpers.vla import tiny_observations, tiny_smolvla

# Group rollouts need whole episodes: 10 decisions x 4 steps cover tiny_config's 40-step episodes.
GRPO = {"algorithm.algo": "grpo", "algorithm.group_size": 2, "actors.decisions_per_rollout": 10, "env.reward": "dense"}


def test_smolvla_reference_copies_only_what_trains() -> None:
    """With the VLM frozen, the reference holds a copy of the trained heads only and scores like the policy."""
    policy = tiny_smolvla().eval()
    reference = frozen_reference(policy)
    policy_storage = {p.data_ptr() for p in policy.parameters()}
    copied = [p for p in reference.parameters() if p.data_ptr() not in policy_storage]
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert sum(p.numel() for p in copied) == sum(p.numel() for p in trainable) < sum(p.numel() for p in policy.parameters()) / 5
    obs = tiny_observations(policy, 4)
    with torch.no_grad():
        features = policy.encode(obs)  # the frozen encoder's features serve both (Learner.prepare relies on this)
        chains = sample_chain(policy, features, 4).chain
        kl, _ = kl_to_reference(chain_log_prob(policy, features, chains), chain_log_prob(reference, reference.encode(obs), chains),
                                num_log_prob_elements(policy.config), "exact")  # fmt: skip
    assert torch.equal(kl, torch.zeros_like(kl))


def grpo_learner(tmp_path, bc_checkpoint, **overrides):
    config = tiny_config(tmp_path, **{**GRPO, **overrides})
    actor = RolloutActor(config, 0, bc_checkpoint)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint, **config.policy.sampling_overrides()))
    return config, actor, learner


def test_grpo_update_trains_no_critic_and_the_reference_never_changes(tmp_path, bc_checkpoint) -> None:
    _, actor, learner = grpo_learner(tmp_path, bc_checkpoint, **{"algorithm.kl_beta": 0.1})
    initial = load_file(str(bc_checkpoint / "model.safetensors"))
    critic = set(learner.policy.critic_parameter_names())
    assert not critic & set(learner.broadcast().params)  # no critic is broadcast
    for iteration in range(3):
        metrics = learner.update(actor.sample(learner.broadcast(), iteration))
        assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5
        assert metrics["grpo/groups"] >= 1 and "losses/v_loss" not in metrics
        assert np.isfinite(metrics["losses/kl_ref"]) and metrics["kl_ref/max"] >= metrics["kl_ref/mean"] >= 0
    assert metrics["kl_ref/mean"] > 0  # the policy moved away from the reference
    assert metrics["logprob/reference_per_element"] != metrics["logprob/per_element"]
    policy_state, reference_state = learner.policy.state_dict(), learner.reference.state_dict()
    for name, value in initial.items():
        assert torch.equal(reference_state[name], torch.from_numpy(value)), name  # bit-identical after 3 updates
        if name in critic:
            assert torch.equal(policy_state[name], torch.from_numpy(value)), name
    assert not torch.equal(policy_state["velocity_net.0.weight"], torch.from_numpy(initial["velocity_net.0.weight"]))
    assert not learner.reference.training


def test_without_kl_no_reference_is_built(tmp_path, bc_checkpoint) -> None:
    _, _, learner = grpo_learner(tmp_path, bc_checkpoint)
    assert learner.reference is None


def test_group_members_share_initial_states_and_mixed_groups_are_refused(tmp_path, bc_checkpoint) -> None:
    _, actor, learner = grpo_learner(tmp_path, bc_checkpoint, **{"actors.envs_per_actor": 4})
    batch = actor.sample(None, 0)
    np.testing.assert_array_equal(batch.obs.state[0, 0], batch.obs.state[0, 1])  # group (0, 1) starts from one state
    np.testing.assert_array_equal(batch.obs.state[0, 2], batch.obs.state[0, 3])
    assert not np.array_equal(batch.obs.state[0, 0], batch.obs.state[0, 2])  # another group, another layout
    learner.update(batch)  # the learner's own check passes on every later episode too

    ppo_config = tiny_config(tmp_path, **{"actors.decisions_per_rollout": 10})  # independent layouts per env
    ppo_batch = RolloutActor(ppo_config, 0, bc_checkpoint).sample(None, 0)
    with pytest.raises(ValueError, match="started episode 0 from different states"):
        learner.update(ppo_batch)


def test_checkpoint_keeps_the_reference_for_resume(tmp_path, bc_checkpoint) -> None:
    config, actor, learner = grpo_learner(tmp_path, bc_checkpoint, **{"algorithm.kl_beta": 0.1})
    learner.update(actor.sample(learner.broadcast(), 0))
    learner.save_checkpoint(tmp_path / "k1")
    assert (tmp_path / "k1" / REFERENCE_DIR / "model.safetensors").is_file()
    resumed = Learner(config, FlowPolicy.from_pretrained(tmp_path / "k1", **config.policy.sampling_overrides()))
    resumed.load_trainer_state(tmp_path / "k1")
    for name, value in learner.reference.state_dict().items():
        assert torch.equal(resumed.reference.state_dict()[name], value), name

    _, _, no_kl = grpo_learner(tmp_path, bc_checkpoint)
    no_kl.save_checkpoint(tmp_path / "k0")
    with pytest.raises(CheckpointError, match="holds no KL reference"):
        resumed.load_trainer_state(tmp_path / "k0")


def test_a_grpo_rollout_where_every_group_broke_is_a_skipped_update(tmp_path, bc_checkpoint) -> None:
    _, actor, learner = grpo_learner(tmp_path, bc_checkpoint)
    batch = actor.sample(None, 0)
    batch.valid[:, 0] = False  # env 0 broke every episode: its group (0, 1) has none left to compare
    with pytest.warns(RuntimeWarning, match="every group that completed an episode has one an env ended with NaN/Inf"):
        assert learner.update(batch)["faults/skipped_update"] == 1.0
