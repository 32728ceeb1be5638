"""GRPO and KL to a frozen reference: group advantages against plain loops, the KL term against the exact
Gaussian KL, the reference frozen through training, group rollouts, and a GRPO run on local Ray."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from actors.rollout_actor import RolloutActor
from common.config import ConfigError, PolicyConfig
from common.flow import chain_log_prob, num_log_prob_elements, sample_chain
from common.observation import Observation
from common.policy import CheckpointError, FlowPolicy, build_policy
from common.rl import group_advantages, grpo_advantages, k3, kl_to_reference
from learner.checkpoints import REFERENCE_DIR
from learner.learner import Learner, frozen_reference
from tests.conftest import tiny_config

# Group rollouts need whole episodes: 10 decisions x 4 steps cover tiny_config's 40-step episodes.
GRPO = {"algorithm.algo": "grpo", "algorithm.group_size": 2, "actors.decisions_per_rollout": 10, "env.reward": "dense"}


# -- group-relative advantages ---------------------------------------------------------------------


def test_group_advantages_match_a_plain_loop_in_both_variants() -> None:
    returns = torch.tensor([[1.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [2.5, 2.0, 0.5, 1.0]])
    for std_normalization in (True, False):
        advantages, metrics = group_advantages(returns, std_normalization, eps=1e-4)
        for group, row in enumerate(returns.tolist()):
            mean, std = statistics.mean(row), statistics.stdev(row)
            for member, value in enumerate(row):
                expected = (value - mean) / (std + 1e-4) if std_normalization else value - mean
                assert advantages[group, member].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert metrics["groups_all_equal"].item() == 1
        assert torch.equal(advantages[1], torch.zeros(4))  # all-failure group: exactly zero, never 0/eps noise or NaN
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1), True)


def plain_episodes(rewards: torch.Tensor, discounts: torch.Tensor, ends: torch.Tensor) -> list[list[tuple[int, int, bool, float]]]:
    """Each env's episodes as (first decision, last decision, complete, discounted return), by a plain loop."""
    num_decisions, num_envs = rewards.shape
    episodes = []
    for n in range(num_envs):
        start, env_episodes = 0, []
        for t in range(num_decisions):
            if ends[t, n] or t == num_decisions - 1:
                ret, factor = 0.0, 1.0
                for s in range(start, t + 1):
                    ret += factor * rewards[s, n].item()
                    factor *= discounts[s, n].item()
                env_episodes.append((start, t, bool(ends[t, n]), ret))
                start = t + 1
        episodes.append(env_episodes)
    return episodes


def test_grpo_advantages_on_a_hand_made_rollout() -> None:
    """T = 5 decisions, N = 4 envs in groups (0, 1) and (2, 3), against a plain loop over envs and episodes."""
    torch.manual_seed(0)
    ends = torch.zeros(5, 4, dtype=torch.bool)
    ends[[1, 4, 2, 4, 0, 3], [0, 0, 1, 2, 3, 3]] = True  # env 1's second episode and env 3's third are cut off
    terminated, truncated = ends.clone(), torch.zeros_like(ends)
    terminated[4, 0], truncated[4, 0] = False, True
    rewards, discounts = torch.rand(5, 4), 0.9 + 0.1 * torch.rand(5, 4)
    rewards[:, 2] = 0.0
    rewards[0, 3] = 0.0  # group 1's first episodes both return 0: an all-equal group

    episodes = plain_episodes(rewards, discounts, ends)
    expected_adv, expected_mask = torch.zeros(5, 4), torch.zeros(5, 4, dtype=torch.bool)
    complete_groups = all_equal = 0
    for g in range(2):
        members = (2 * g, 2 * g + 1)
        for k in range(3):
            found = [episodes[n][k] if k < len(episodes[n]) else None for n in members]
            if not all(e is not None and e[2] for e in found):
                continue
            complete_groups += 1
            rets = [e[3] for e in found]
            all_equal += len(set(rets)) == 1
            for n, (first, last, _, ret) in zip(members, found):
                expected_mask[first : last + 1, n] = True
                if len(set(rets)) > 1:
                    expected_adv[first : last + 1, n] = (ret - statistics.mean(rets)) / (statistics.stdev(rets) + 1e-4)

    valid = torch.ones_like(ends)
    advantages, mask, metrics = grpo_advantages(rewards, discounts, terminated, truncated, valid, 2, True)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(advantages, expected_adv)
    assert (complete_groups, all_equal) == (2, 1)
    assert metrics["groups"].item() == 2 and metrics["groups_all_equal"].item() == 1
    assert metrics["groups_incomplete"].item() == 3  # (group 0, ep 1), (group 1, ep 1), (group 1, ep 2)
    assert metrics["groups_broken"].item() == 0
    assert metrics["episodes_cut_off"].item() == 2
    assert metrics["masked_decision_frac"].item() == pytest.approx(9 / 20)
    dr_advantages, dr_mask, _ = grpo_advantages(rewards, discounts, terminated, truncated, valid, 2, False)
    assert torch.equal(dr_mask, mask)
    ret00, ret10 = episodes[0][0][3], episodes[1][0][3]
    assert dr_advantages[0, 0].item() == pytest.approx(ret00 - (ret00 + ret10) / 2)  # Dr. GRPO keeps the return's scale


def test_an_episode_an_env_broke_takes_its_group_out_of_the_statistics() -> None:
    """T = 4, N = 6 in groups of 3; every env ends episodes at t = 1 and t = 3. Env 1 breaks its second episode
    (NaN output at t = 3: truncated there, its decisions invalid), so group-episode (0, 1) is dropped whole: its
    other members' advantages must not be computed against the broken one's cut-short return."""
    torch.manual_seed(1)
    rewards, discounts = torch.rand(4, 6), 0.9 + 0.1 * torch.rand(4, 6)
    terminated = torch.zeros(4, 6, dtype=torch.bool)
    terminated[[1, 3]] = True
    truncated = torch.zeros_like(terminated)
    terminated[3, 1], truncated[3, 1] = False, True
    valid = torch.ones_like(terminated)
    valid[2:, 1] = False
    episodes = plain_episodes(rewards, discounts, terminated | truncated)
    expected_adv, expected_mask = torch.zeros(4, 6), torch.ones(4, 6, dtype=torch.bool)
    expected_mask[2:, 0:3] = False  # group 0's second episodes, all three members
    used = []
    for g, k in ((0, 0), (1, 0), (1, 1)):
        members = range(3 * g, 3 * g + 3)
        rets = [episodes[n][k][3] for n in members]
        used += rets
        for n, ret in zip(members, rets):
            first, last = episodes[n][k][:2]
            expected_adv[first : last + 1, n] = (ret - statistics.mean(rets)) / (statistics.stdev(rets) + 1e-4)

    advantages, mask, metrics = grpo_advantages(rewards, discounts, terminated, truncated, valid, 3, True)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(advantages, expected_adv)
    assert (metrics["groups"].item(), metrics["groups_broken"].item(), metrics["groups_incomplete"].item()) == (3, 1, 0)
    assert metrics["episode_return"].item() == pytest.approx(statistics.mean(used))


# -- KL to the reference ---------------------------------------------------------------------------


def small_policy() -> FlowPolicy:
    torch.manual_seed(0)
    config = PolicyConfig(chunk_size=2, action_dim=2, num_steps=2, hidden_dim=32, num_layers=2, init_noise_std=0.0)
    return build_policy(config).eval()


def perturb(policy: FlowPolicy, scale: float, module: str = "velocity_net") -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in getattr(policy, module).parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


@torch.no_grad()
def scores_on_policy_chains(policy: FlowPolicy, reference: FlowPolicy, num_chains: int):
    """Chains sampled from `policy`, scored by both."""
    generator = torch.Generator().manual_seed(2)
    obs = Observation(torch.randn(num_chains, policy.config.obs_dim, generator=generator))
    chains = sample_chain(policy, policy.encode(obs), num_chains, generator=generator).chain
    return chain_log_prob(policy, policy.encode(obs), chains), chain_log_prob(reference, reference.encode(obs), chains)


def test_kl_term_is_zero_for_the_reference_and_grows_as_the_policy_diverges() -> None:
    reference = frozen_reference(small_policy())
    elements = num_log_prob_elements(reference)
    kls: dict[str, list[float]] = {name: [] for name in ("exact", "k1", "k2", "k3")}
    for scale in (0.0, 0.01, 0.03, 0.1):
        policy = small_policy()  # the reference's weights, then moved along one fixed direction
        perturb(policy, scale)
        scores = scores_on_policy_chains(policy, reference, 4000)
        for name in kls:
            kl, metrics = kl_to_reference(*scores, elements, name)
            if scale == 0.0:
                assert torch.equal(kl, torch.zeros_like(kl)), name  # policy == reference: exactly zero
            assert metrics["kl_ref_max"] >= metrics["kl_ref"]
            kls[name].append(metrics["kl_ref"].item())
    for name, values in kls.items():
        assert all(a < b for a, b in zip(values, values[1:])), (name, values)


def test_k3_term_estimates_kl_policy_to_reference_and_the_reversed_formula_does_not() -> None:
    """Monte Carlo over chains sampled from the policy, against the exact Gaussian KL of the same chains."""
    policy = small_policy()
    reference = frozen_reference(policy)
    perturb(policy, 0.03)
    elements = num_log_prob_elements(policy)
    policy_scores, reference_scores = scores_on_policy_chains(policy, reference, 100_000)
    exact = kl_to_reference(policy_scores, reference_scores, elements, "exact")[0].mean().item()
    assert 0.05 < exact * elements < 2.0  # a chain KL where the two directions differ visibly
    for name in ("k1", "k3"):  # unbiased estimators of KL(policy || reference)
        estimate = kl_to_reference(policy_scores, reference_scores, elements, name)[0].mean().item()
        assert estimate == pytest.approx(exact, rel=0.05), name
    reversed_formula = kl_to_reference(reference_scores, policy_scores, elements, "k3")[0].mean().item()
    assert abs(reversed_formula - exact) > 0.3 * exact
    # k3 fed per-element-MEAN log-probs (not joint log-densities) measures roughly KL / D^2, not KL / D.
    misused = k3(policy_scores.log_prob_per_element, reference_scores.log_prob_per_element).mean().item()
    assert misused < 2.0 * exact / elements


def test_reference_shares_frozen_parts_and_copies_trainable_ones() -> None:
    policy = small_policy()
    policy.critic_net.requires_grad_(False)  # as with GRPO: a frozen critic
    reference = frozen_reference(policy)
    assert reference.critic_net[0].weight is policy.critic_net[0].weight
    assert reference.obs_mean is policy.obs_mean  # buffers: fixed normalisation, shared
    assert reference.velocity_net[0].weight is not policy.velocity_net[0].weight
    assert reference.velocity_net[0].weight.data_ptr() != policy.velocity_net[0].weight.data_ptr()
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert policy.velocity_net[0].weight.requires_grad  # the policy itself is untouched


def test_smolvla_reference_copies_only_what_trains() -> None:
    """With the VLM frozen, the reference holds a copy of the trained heads only and scores like the policy."""
    from tests.test_smolvla import tiny_policy
    from tests.vla_checks import tiny_observations as observations

    policy = tiny_policy().eval()
    reference = frozen_reference(policy)
    policy_storage = {p.data_ptr() for p in policy.parameters()}
    copied = [p for p in reference.parameters() if p.data_ptr() not in policy_storage]
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert sum(p.numel() for p in copied) == sum(p.numel() for p in trainable) < sum(p.numel() for p in policy.parameters()) / 5
    obs = observations(policy, 4)
    with torch.no_grad():
        features = policy.encode(obs)  # the frozen encoder's features serve both (Learner.prepare relies on this)
        chains = sample_chain(policy, features, 4).chain
        kl, _ = kl_to_reference(chain_log_prob(policy, features, chains), chain_log_prob(reference, reference.encode(obs), chains),
                                num_log_prob_elements(policy), "exact")  # fmt: skip
    assert torch.equal(kl, torch.zeros_like(kl))


# -- the learner and the rollout actors ------------------------------------------------------------


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
    np.testing.assert_array_equal(batch.obs[0, 0], batch.obs[0, 1])  # group (0, 1) starts from one state
    np.testing.assert_array_equal(batch.obs[0, 2], batch.obs[0, 3])
    assert not np.array_equal(batch.obs[0, 0], batch.obs[0, 2])  # another group, another layout
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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"actors.envs_per_actor": 3}, r"actors\.envs_per_actor \(3\) must be a multiple of algorithm\.group_size"),
        ({"actors.decisions_per_rollout": 8}, r"decisions_per_rollout \* policy\.chunk_size \(32\) must be >= env\.max_episode_steps"),
        ({"algorithm.group_size": 1}, r"algorithm\.group_size must be >= 2"),
        ({"algorithm.kl_estimator": "k4"}, r"algorithm\.kl_estimator must be one of"),
        ({"algorithm.kl_beta": -1}, r"algorithm\.kl_beta must be >= 0"),
        ({"algorithm.algo": "dpo"}, r"algorithm\.algo must be one of"),
    ],
)
def test_bad_grpo_and_kl_settings_name_the_field(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, **{**GRPO, **overrides})


# -- end to end on local Ray -----------------------------------------------------------------------


@pytest.fixture()
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never join a run already going
    yield
    ray.shutdown()


@pytest.mark.slow
def test_grpo_with_kl_on_local_ray_with_two_actors(tmp_path, bc_checkpoint, local_ray) -> None:
    from learner.main import main

    run_dir = tmp_path / "run"
    sets = ["actors.envs_per_actor=2", "actors.decisions_per_rollout=10", "env.max_episode_steps=40", "env.reward=dense",
            "algorithm.group_size=2", "algorithm.kl_beta=0.1", "algorithm.minibatch_size=16", "algorithm.update_epochs=2",
            "eval_every=0", "eval_episodes=4", "checkpoint_every=1"]  # fmt: skip
    argv = ["--algo", "grpo", "--num-actors", "2", "--iterations", "2", "--run-dir", str(run_dir), "--checkpoint", str(bc_checkpoint)]
    assert main(argv + [arg for item in sets for arg in ("--set", item)]) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5
        assert row["grpo/groups"] >= 2  # one complete group per actor at least: groups never span actors
        assert "losses/v_loss" not in row and np.isfinite(row["losses/kl_ref"])
    final = load_file(str(run_dir / "checkpoints" / "iter_000002" / "model.safetensors"))
    reference = load_file(str(run_dir / "checkpoints" / "iter_000002" / REFERENCE_DIR / "model.safetensors"))
    initial = load_file(str(bc_checkpoint / "model.safetensors"))
    for name, value in initial.items():
        np.testing.assert_array_equal(reference[name], value, err_msg=name)
        if name.startswith("critic_net"):
            np.testing.assert_array_equal(final[name], value, err_msg=name)  # no critic trained
    assert not np.array_equal(final["velocity_net.0.weight"], initial["velocity_net.0.weight"])
