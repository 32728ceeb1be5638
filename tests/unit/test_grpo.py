"""GRPO and KL to a frozen reference, as math: group advantages against plain loops, the KL term against the exact
Gaussian KL, the reference's shared and copied parts, and the settings refused by name."""

from __future__ import annotations

import re
import statistics

import pytest
import torch

from common.config import ConfigError, PolicyConfig
from common.flow import chain_log_prob, num_log_prob_elements, sample_chain
from common.observation import Observation
from common.policy import FlowPolicy, build_policy
from common.rl import group_advantages, grpo_advantages, k3, kl_to_reference
from learner.update.learner import frozen_reference
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
    config = PolicyConfig(chunk_size=2, action_dim=2, num_steps=2, hidden_dim=32, num_layers=2)
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
    elements = num_log_prob_elements(reference.config)
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
    elements = num_log_prob_elements(policy.config)
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


@pytest.mark.parametrize("differs_at, message", [(None, None), ((0, 1), "group 0 (envs 0..1 of the batch) started episode 0"),
                                                 ((3, 3), "group 1 (envs 2..3 of the batch) started episode 1")])  # fmt: skip
def test_grpo_refuses_a_group_whose_members_started_an_episode_from_different_states(differs_at, message):
    """The k-th episodes of a group's members must start alike: checked on the episodes grpo_advantages finds, each start
    (t = 0 or the decision after an end) against the group's first member's. A state that differs mid-episode is no start."""
    terminated = torch.zeros(6, 4, dtype=torch.bool)
    terminated[2, :] = True  # every env ends its first episode at t = 2: the second starts at t = 3
    states = torch.arange(6, dtype=torch.float32)[:, None, None].expand(6, 4, 3).clone()  # each t alike across envs
    states[4, 1] += 1.0  # mid-episode: not a start
    if differs_at is not None:
        states[differs_at] += 0.5
    rewards, valid = torch.ones(6, 4), torch.ones(6, 4, dtype=torch.bool)
    arguments = (rewards, torch.ones(6, 4), terminated, torch.zeros(6, 4, dtype=torch.bool), valid, 2, True)
    if message is None:
        grpo_advantages(*arguments, states=states)
    else:
        with pytest.raises(ValueError, match=re.escape(message) + " from different states"):
            grpo_advantages(*arguments, states=states)
