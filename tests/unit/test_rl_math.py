"""GAE, PPO losses and KL estimators against hand computations and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal, kl_divergence

from common.rl import EXPLAINED_VARIANCE_MOMENTS, explained_variance_of_moments, gae, k1, k2, k3, ppo_policy_loss, value_loss


def test_gae_hand_computed_episode_with_mid_chunk_termination() -> None:
    """One env, 4 decisions of H = 3 steps; the episode terminates after 2 steps of decision 2,
    a new one starts at decision 3 and the rollout stops mid-episode (bootstrap)."""
    gamma, lam = 0.9, 0.8
    step_rewards = [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 5.0], [1.0, 0.0, 0.0]]
    chunk_rewards = [sum(gamma**i * r for i, r in enumerate(rs)) for rs in step_rewards]
    steps = [len(rs) for rs in step_rewards]
    values = [0.5, 0.6, 0.7, 0.2]
    next_values = [0.6, 0.7, 123.0, 0.3]  # 123: the terminal state's value must be ignored
    terminated = [False, False, True, False]

    # By hand, from the definitions.
    d = [chunk_rewards[t] + (0 if terminated[t] else gamma ** steps[t] * next_values[t]) - values[t] for t in range(4)]
    a3 = d[3]
    a2 = d[2]  # terminal: the trace stops
    a1 = d[1] + gamma ** steps[1] * lam * a2
    a0 = d[0] + gamma ** steps[0] * lam * a1
    expected = torch.tensor([a0, a1, a2, a3])

    col = lambda xs, dtype=torch.float32: torch.tensor(xs, dtype=dtype)[:, None]  # noqa: E731
    advantages, returns = gae(
        col(chunk_rewards), col(values), col(next_values), col([gamma**s for s in steps]),
        col(terminated, torch.bool), col([False] * 4, torch.bool), lam,
    )  # fmt: skip
    torch.testing.assert_close(advantages[:, 0], expected)
    torch.testing.assert_close(returns[:, 0], expected + col(values)[:, 0])
    assert abs(a2 - (chunk_rewards[2] - values[2])) < 1e-9  # sanity: 0.9 * 5 - 0.7


def test_gae_truncation_bootstraps_but_stops_the_trace() -> None:
    rewards, values = torch.tensor([[1.0], [1.0]]), torch.tensor([[0.0], [0.0]])
    next_values, discounts = torch.tensor([[10.0], [20.0]]), torch.tensor([[0.5], [0.5]])
    no = torch.zeros(2, 1, dtype=torch.bool)
    truncated = torch.tensor([[True], [False]])
    advantages, _ = gae(rewards, values, next_values, discounts, no, truncated, 1.0)
    assert advantages[0, 0].item() == pytest.approx(1.0 + 0.5 * 10.0)  # bootstrapped, not chained to t=1
    assert advantages[1, 0].item() == pytest.approx(1.0 + 0.5 * 20.0)


def test_gae_matches_plain_loop_on_random_batch() -> None:
    torch.manual_seed(0)
    T, N, lam = 17, 5, 0.95
    r, v, nv = torch.randn(T, N), torch.randn(T, N), torch.randn(T, N)
    disc = 0.99 ** torch.randint(1, 5, (T, N)).float()
    term, trunc = torch.rand(T, N) < 0.1, torch.rand(T, N) < 0.1
    adv, _ = gae(r, v, nv, disc, term, trunc, lam)
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            delta = r[t, n] + (0.0 if term[t, n] else disc[t, n] * nv[t, n]) - v[t, n]
            running = delta + (0.0 if (term[t, n] or trunc[t, n]) else disc[t, n] * lam * running)
            assert adv[t, n].item() == pytest.approx(float(running), abs=1e-5)


def test_ppo_policy_loss_against_plain_loop() -> None:
    torch.manual_seed(1)
    new, old, adv, eps = torch.randn(50) * 0.1, torch.randn(50) * 0.1, torch.randn(50), 0.1
    loss, metrics = ppo_policy_loss(new, old, adv, eps)
    terms, clipped = [], 0
    for n, o, a in zip(new.tolist(), old.tolist(), adv.tolist()):
        r = math.exp(n - o)
        terms.append(max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)))
        clipped += abs(r - 1) > eps
    assert loss.item() == pytest.approx(sum(terms) / 50, rel=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(clipped / 50)
    # approx_kl is CleanRL's ((ratio - 1) - logratio).mean()
    ratio = (new - old).exp()
    assert metrics["approx_kl"].item() == pytest.approx(((ratio - 1) - (new - old)).mean().item(), rel=1e-5)


def test_decoupled_ppo_loss_weights_each_clipped_term_by_prox_over_behaviour() -> None:
    """actors.policy_lag > 0: the clip stays around the proximal policy and each sample's clipped term is
    multiplied by pi_prox / pi_behaviour; a weight of exactly 1 is the synchronous loss, bit for bit."""
    torch.manual_seed(2)
    new, prox, behaviour, adv, eps = torch.randn(40) * 0.1, torch.randn(40) * 0.1, torch.randn(40) * 0.1, torch.randn(40), 0.05
    weight = (prox - behaviour).exp()
    loss, metrics = ppo_policy_loss(new, prox, adv, eps, weight)
    terms = []
    for n, o, b, a in zip(new.tolist(), prox.tolist(), behaviour.tolist(), adv.tolist()):
        r = math.exp(n - o)
        terms.append(math.exp(o - b) * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)))
    assert loss.item() == pytest.approx(sum(terms) / 40, rel=1e-5)
    assert metrics["approx_kl"].item() == pytest.approx(((new - prox).exp() - 1 - (new - prox)).mean().item(), rel=1e-5)
    synchronous, _ = ppo_policy_loss(new, prox, adv, eps)
    assert torch.equal(ppo_policy_loss(new, prox, adv, eps, torch.ones(40))[0], synchronous)
    assert not torch.equal(loss, synchronous)


def test_ppo_gradient_is_zero_where_clipped() -> None:
    old = torch.zeros(2)
    new = torch.tensor([0.5, 0.5], requires_grad=True)  # ratio e^0.5, far outside 1 +- 0.2
    loss, _ = ppo_policy_loss(new, old, torch.tensor([1.0, -1.0]), 0.2)
    loss.backward()
    assert new.grad[0] == 0  # positive advantage, ratio above 1 + eps: clipped, no gradient
    assert new.grad[1] != 0  # negative advantage: the unclipped (pessimistic) term is active


def test_value_loss_clipping() -> None:
    values, returns, old = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0])
    plain, _ = value_loss(values, returns, old, None)
    clipped, _ = value_loss(values, returns, old, 0.5)
    assert plain.item() == pytest.approx(2.0)
    assert clipped.item() == pytest.approx(2.0)  # max(unclipped, clipped) keeps the larger error
    values = torch.tensor([0.2])  # moving towards the target from an old value far away
    old = torch.tensor([3.0])
    assert value_loss(values, returns, old, 0.5)[0].item() == pytest.approx(0.5 * 2.5**2)


def test_k3_estimates_kl_policy_to_reference_and_reversed_does_not() -> None:
    torch.manual_seed(0)
    policy, reference = Normal(0.3, 1.0), Normal(0.0, 0.6)
    x = policy.sample((400_000,))  # samples from the policy, as in RL
    logp, logp_ref = policy.log_prob(x), reference.log_prob(x)
    kl_forward = kl_divergence(policy, reference).item()  # KL(policy || reference)
    kl_reverse = kl_divergence(reference, policy).item()
    assert k3(logp, logp_ref).mean().item() == pytest.approx(kl_forward, rel=0.03)
    assert k1(logp, logp_ref).mean().item() == pytest.approx(kl_forward, rel=0.03)
    assert (k3(logp, logp_ref) >= 0).all()
    reversed_formula = (torch.expm1(logp - logp_ref) - (logp - logp_ref)).mean().item()
    assert abs(reversed_formula - kl_forward) > 0.5 * kl_forward
    assert abs(reversed_formula - kl_reverse) > 0.2 * kl_reverse  # nor is it the other direction's estimate
    # k2 is biased but close for nearby distributions
    near = Normal(0.05, 1.0)
    y = near.sample((400_000,))
    assert k2(near.log_prob(y), Normal(0.0, 1.0).log_prob(y)).mean().item() == pytest.approx(
        kl_divergence(near, Normal(0.0, 1.0)).item(), rel=0.1
    )


CASES = [(0, 10), (0, 20), (1, 20), (37, 100), (61, 100), (99, 100), (100, 100), (10, 10), (3, 7)]  # (successes, episodes)


@pytest.mark.parametrize(("successes", "episodes"), CASES)
def test_success_interval_is_scipys_wilson_interval(successes: int, episodes: int) -> None:
    """The held-out success interval against scipy's Wilson score interval at the same z (1.96) as the evaluation's."""
    from scipy.stats import binomtest, norm

    from common.metrics import success_interval

    outcomes = np.zeros(episodes, dtype=bool)
    outcomes[:successes] = True
    rate, low, high = success_interval(np.random.default_rng(successes).permutation(outcomes))
    expected = binomtest(successes, episodes).proportion_ci(confidence_level=2 * norm.cdf(1.96) - 1, method="wilson")
    assert rate == successes / episodes
    assert low == pytest.approx(expected.low, abs=1e-12) and high == pytest.approx(expected.high, abs=1e-12)
    assert 0 <= low <= rate <= high <= 1 and (low > 0) == (successes > 0) and (high < 1) == (successes < episodes)


@pytest.mark.parametrize("sizes", [[7], [3, 4], [1, 5, 2], [1, 1]])
def test_explained_variance_pooled_from_the_parts_moments_is_the_whole_ones(sizes) -> None:
    """value_loss's moments of parts of a batch, weighted by their sizes, give the explained variance torch computes on
    the whole batch at once, parts of a single decision included (whose own explained variance is NaN)."""
    generator = torch.Generator().manual_seed(sum(sizes))
    returns, values = torch.randn(sum(sizes), generator=generator) * 3 + 1, torch.randn(sum(sizes), generator=generator)
    whole = value_loss(values, returns, values, None)[1]["explained_variance"].item()
    parts = [value_loss(v, r, v, None)[1] for v, r in zip(values.split(sizes), returns.split(sizes), strict=True)]
    moments = {key: sum(float(part[key]) * size for part, size in zip(parts, sizes, strict=True)) / sum(sizes)
               for key in EXPLAINED_VARIANCE_MOMENTS}  # fmt: skip
    assert explained_variance_of_moments(moments, sum(sizes)) == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert math.isnan(explained_variance_of_moments(moments, 1))
