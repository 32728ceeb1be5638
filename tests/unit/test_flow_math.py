"""The chain math against independent computations (torch.distributions, Monte Carlo, plain loops)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.distributions import Normal

from common.config import ConfigError, PolicyConfig
from common.diagnostics import (
    NonDeterministicPolicyError,
    RatioSensitivityWarning,
    check_ratio_is_one,
    check_ratio_sensitivity,
)
from common.flow import chain_log_prob, compile_steps, num_log_prob_elements, sample_chain, step_time, time_grid, transition_kl
from common.observation import Observation
from common.policy import MLPFlowPolicy
from common.policy.mlp import time_embedding
from tests.helpers.dropout import with_dropout


def make_policy(num_steps: int = 4, **overrides) -> MLPFlowPolicy:
    """A small MLP policy whose chains start from the N(0, I) prior unless told otherwise, so a_0's term is checked too."""
    torch.manual_seed(0)
    config = PolicyConfig(**{"obs_dim": 6, "action_dim": 3, "chunk_size": 2, "num_steps": num_steps, "hidden_dim": 32, "num_layers": 2,
                             "init_noise_std": 1.0, **overrides})  # fmt: skip
    return MLPFlowPolicy(config).eval()


def independent_log_prob(policy: MLPFlowPolicy, obs: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Summed log-density of chains, written from the definition with torch.distributions."""
    features = policy.encode(Observation(obs))
    num_steps = policy.num_steps
    total = Normal(0.0, policy.config.init_noise_std).log_prob(chain[:, 0]).sum((-1, -2))
    for k in range(num_steps):
        t = torch.full((chain.shape[0],), k / num_steps)
        mean = chain[:, k] + policy.velocity(chain[:, k], t, features) / num_steps
        std = policy.sigma(t, features)
        total = total + Normal(mean, std).log_prob(chain[:, k + 1]).sum((-1, -2))
    return total


@pytest.mark.parametrize("num_steps", [1, 2, 4, 10])
@pytest.mark.parametrize("normalization", ["sum", "mean"])
@pytest.mark.parametrize("steps_in_one_pass", [False, True])
def test_chain_log_prob_matches_torch_distributions(num_steps: int, normalization: str, steps_in_one_pass: bool) -> None:
    policy = make_policy(num_steps, log_prob_normalization=normalization)
    obs = torch.randn(7, 6)
    with torch.no_grad():
        chain = sample_chain(policy, policy.encode(Observation(obs)), 7, generator=torch.Generator().manual_seed(1)).chain
        expected_sum = independent_log_prob(policy, obs, chain)
        scored = chain_log_prob(policy, policy.encode(Observation(obs)), chain, steps_in_one_pass=steps_in_one_pass)
    elements = (num_steps + 1) * 2 * 3
    assert num_log_prob_elements(policy.config) == elements
    torch.testing.assert_close(scored.log_prob_per_element, expected_sum / elements, rtol=1e-5, atol=1e-5)
    expected = expected_sum if normalization == "sum" else expected_sum / elements
    torch.testing.assert_close(scored.log_prob, expected, rtol=1e-5, atol=1e-4)


def test_steps_in_one_pass_give_the_step_by_steps_gradients_and_refuse_recomputing() -> None:
    """All K steps as one pass of K x B rows: the same log-probs, means, stds and gradients as K passes, up to float
    rounding; recomputing step by step has no steps to recompute there, and is refused."""
    policy = make_policy(10, init_noise_std=1.0)
    features = policy.encode(Observation(torch.randn(5, 6)))
    with torch.no_grad():
        chain = sample_chain(policy, features, 5, generator=torch.Generator().manual_seed(2)).chain
    results = []
    for one_pass in (False, True):
        policy.zero_grad()
        scored = chain_log_prob(policy, features, chain, steps_in_one_pass=one_pass)
        scored.log_prob.sum().backward()
        results.append((scored, {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}))
    (steps, step_grads), (one, one_grads) = results
    for name in ("log_prob", "entropy", "mean", "std"):
        torch.testing.assert_close(getattr(one, name), getattr(steps, name), rtol=1e-5, atol=1e-6)
    assert step_grads.keys() == one_grads.keys() and any(name.startswith("noise_net") for name in one_grads)
    for name, grad in step_grads.items():
        torch.testing.assert_close(one_grads[name], grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="steps_in_one_pass"):
        chain_log_prob(policy, features, chain, recompute_steps=True, steps_in_one_pass=True)


def test_zero_init_noise_drops_the_a0_term() -> None:
    policy = make_policy(3, init_noise_std=0.0)
    obs = torch.randn(5, 6)
    with torch.no_grad():
        sample = sample_chain(policy, policy.encode(Observation(obs)), 5, generator=torch.Generator().manual_seed(2))
        assert torch.all(sample.chain[:, 0] == 0)
        policy.config = dataclasses.replace(policy.config, init_noise_std=1.0)
        with_prior = chain_log_prob(policy, policy.encode(Observation(obs)), sample.chain).log_prob_per_element * (4 * 6)
    # The a_0 = 0 term under N(0, 1) is -0.5 log(2 pi) per element; removing it recovers the K-step sum.
    torch.testing.assert_close(sample.scores.log_prob_per_element * (3 * 6), with_prior + 6 * 0.5 * torch.log(torch.tensor(2 * torch.pi)))


@pytest.mark.parametrize("num_steps", [1, 2, 4, 10])
def test_fresh_chain_scores_with_ratio_one(num_steps: int) -> None:
    """The behaviour log-prob recorded while sampling equals the learner's rescoring (one time grid)."""
    policy = make_policy(num_steps, log_prob_normalization="sum")
    obs = torch.randn(64, 6)
    with torch.no_grad():
        sample = sample_chain(policy, policy.encode(Observation(obs)), 64, generator=torch.Generator().manual_seed(3))
        # Rescore in a different batch composition (minibatches of 5) to mimic the learner.
        rescored = torch.cat(
            [chain_log_prob(policy, policy.encode(Observation(obs[i : i + 5])), sample.chain[i : i + 5]).log_prob for i in range(0, 64, 5)]
        )
    assert (rescored - sample.scores.log_prob).abs().max() < 1e-6 * max(1.0, float(rescored.abs().max()))


def test_time_grid_is_the_single_source() -> None:
    times, dt = time_grid(4)
    assert times.tolist() == [0.0, 0.25, 0.5, 0.75] and dt == 0.25
    # ReinFlow issue #5: scoring on linspace(0, 1 - dt, K) after sampling on linspace(0, 1, K) breaks ratio = 1.
    assert not torch.equal(times, torch.linspace(0, 1, 4))


def test_the_policys_shortcuts_give_the_plain_modules_bits() -> None:
    """step_time's shared tensors, MLPFlowPolicy.embed_time's memo and MLP's functional forward: each must leave every
    bit as the plain computation has it, forward and backward, in eval and train mode."""
    policy = with_dropout(make_policy(4), 0.2)
    t, dt = step_time(4, 1, 5, torch.device("cpu"))
    assert t is step_time(4, 1, 5, torch.device("cpu"))[0] and dt == time_grid(4)[1]
    assert torch.equal(t, time_grid(4)[0][1].expand(5))
    first = policy.embed_time(t)
    assert policy.embed_time(t) is first and torch.equal(first, time_embedding(t, policy.config.time_embed_dim))
    fresh = torch.rand(5)
    before = policy.embed_time(fresh)
    fresh.add_(0.5)  # written in place: the memo must see the new values
    assert torch.equal(policy.embed_time(fresh), time_embedding(fresh, policy.config.time_embed_dim))
    assert not torch.equal(policy.embed_time(fresh), before)
    differentiated = torch.rand(5, requires_grad=True)  # a time that is differentiated gets its own graph at every call
    first_graph = policy.embed_time(differentiated)
    assert first_graph.grad_fn is not None and policy.embed_time(differentiated) is not first_graph

    x = torch.randn(7, policy.velocity_net[0].in_features)
    plain = torch.nn.Sequential(*policy.velocity_net)  # the same layers, called as modules
    by_mode = []
    for train in (False, True):
        policy.train(train)
        outputs, grads = [], []
        for net in (policy.velocity_net, plain):
            torch.manual_seed(3)  # the same dropout masks in train mode
            out = net(x)
            (out**2).sum().backward()
            outputs.append(out.detach())
            grads.append([p.grad.clone() for p in net.parameters()])
            policy.zero_grad()
        assert torch.equal(outputs[0], outputs[1])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        by_mode.append(outputs[0])
    assert not torch.equal(*by_mode)  # train mode really dropped units


def test_deterministic_sampling_is_noise_free_and_repeatable() -> None:
    policy = make_policy(4)
    obs = torch.randn(3, 6)
    with torch.no_grad():
        a = sample_chain(policy, policy.encode(Observation(obs)), 3, deterministic=True, generator=torch.Generator().manual_seed(1)).chain
        b = sample_chain(policy, policy.encode(Observation(obs)), 3, deterministic=True, generator=torch.Generator().manual_seed(2)).chain
    assert torch.equal(a, b)
    assert torch.all(a[:, 0] == 0)


def test_deterministic_sampling_from_lerobots_start_draws_a0_and_injects_no_noise() -> None:
    """eval_init_noise_std 1.0: a_0 from N(0, I) drawn by the generator (lerobot's sampler starts there), then every
    step the transition's mean, its noise left out; the same generator gives the same chain. It needs a policy trained
    from random starts (init_noise_std > 0)."""
    policy = make_policy(3, eval_init_noise_std=1.0)
    obs = torch.randn(3, 6)
    with torch.no_grad():
        features = policy.encode(Observation(obs))
        chain = sample_chain(policy, features, 3, deterministic=True, generator=torch.Generator().manual_seed(4)).chain
        again = sample_chain(policy, features, 3, deterministic=True, generator=torch.Generator().manual_seed(4)).chain
        assert torch.equal(chain, again)
        assert torch.equal(chain[:, 0], torch.randn((3, 2, 3), generator=torch.Generator().manual_seed(4)))
        for k in range(3):
            t = torch.full((3,), k / 3)
            torch.testing.assert_close(chain[:, k + 1], chain[:, k] + policy.velocity(chain[:, k], t, features) / 3, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match=r"eval_init_noise_std must be 0, or > 0 with policy\.init_noise_std > 0"):
        PolicyConfig(init_noise_std=0.0, eval_init_noise_std=1.0).validate()


def test_sigma_is_bounded() -> None:
    policy = make_policy(2, sigma_min=0.08, sigma_max=0.14)
    with torch.no_grad():
        for layer in policy.noise_net:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(100.0)  # push the tanh into saturation both ways
        sigma = policy.sigma(torch.rand(256), policy.encode(Observation(torch.randn(256, 6) * 10)))
    assert sigma.min() >= 0.08 - 1e-6 and sigma.max() <= 0.14 + 1e-6
    assert sigma.max() - sigma.min() > 0.04  # both ends reached: the bound is a bound, not a constant


def test_transition_kl_matches_torch_distributions() -> None:
    p, q = make_policy(3), make_policy(3)
    with torch.no_grad():
        for param in q.parameters():
            param.add_(0.05 * torch.randn_like(param))
        obs = torch.randn(4, 6)
        chain = sample_chain(p, p.encode(Observation(obs)), 4, generator=torch.Generator().manual_seed(0)).chain
        sp, sq = chain_log_prob(p, p.encode(Observation(obs)), chain), chain_log_prob(q, q.encode(Observation(obs)), chain)
        expected = torch.distributions.kl_divergence(Normal(sp.mean, sp.std), Normal(sq.mean, sq.std)).flatten(1)
        torch.testing.assert_close(transition_kl(sp, sq, "sum"), expected.sum(-1))
        torch.testing.assert_close(transition_kl(sp, sq, "mean"), expected.mean(-1))
        assert torch.all(transition_kl(sp, sp) == 0)
        # Entropy: mean per-element entropy of the transitions.
        torch.testing.assert_close(sp.entropy, Normal(sp.mean, sp.std).entropy().flatten(1).mean(-1))


def test_positive_per_element_log_prob_is_normal_for_small_sigma() -> None:
    policy = make_policy(4, sigma_min=0.05, sigma_max=0.1, init_noise_std=0.0)
    obs = torch.randn(32, 6)
    with torch.no_grad():
        sample = sample_chain(policy, policy.encode(Observation(obs)), 32, generator=torch.Generator().manual_seed(0))
    # Density above 1 near the mean when sigma < 0.4: positive log-probs, by design, not an error.
    assert sample.scores.log_prob_per_element.mean() > 0


def test_dropout_in_train_mode_is_detected() -> None:
    policy = with_dropout(make_policy(4), 0.3)
    obs = torch.randn(16, 6)
    with torch.no_grad():
        chain = sample_chain(policy.eval(), policy.encode(Observation(obs)), 16, generator=torch.Generator().manual_seed(0)).chain

    def evaluate() -> torch.Tensor:
        return chain_log_prob(policy, policy.encode(Observation(obs)), chain).log_prob

    policy.train()
    with torch.no_grad():
        logratio = evaluate() - evaluate()
    with pytest.raises(NonDeterministicPolicyError, match=r"velocity_net\.\d+ \(Dropout, p=0\.3.*eval mode"):
        check_ratio_is_one(logratio, policy, 1e-5)

    policy.eval()
    with torch.no_grad():
        assert check_ratio_is_one(evaluate() - evaluate(), policy, 1e-5) == 0.0


def test_ratio_sensitivity_warning() -> None:
    # SmolVLA-sized chunk (50 x 6 = 300 elements), sigma = 0.1, log-probs summed: warns.
    with pytest.warns(RatioSensitivityWarning, match="log_prob_normalization='mean'"):
        move = check_ratio_sensitivity(300, 0.1, "sum", clip_eps=0.2)
    assert move > 20
    # ReinFlow's setting: per-element mean, H*A = 4 x 7 = 28, sigma in [0.08, 0.14]: silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioSensitivityWarning)
        for sigma in (0.08, 0.14):
            assert check_ratio_sensitivity(28, sigma, "mean", clip_eps=0.01) < 1.0


def test_ratio_sensitivity_prediction_matches_a_measured_shift() -> None:
    """The warning's formula predicts the log-ratio move of an actual mean shift towards the samples."""
    torch.manual_seed(0)
    mean, sigma, shift = torch.zeros(20000, 300), 0.1, 0.01
    samples = mean + sigma * torch.randn_like(mean)
    moved = mean + shift * torch.sign(samples - mean)
    logratio = (Normal(moved, sigma).log_prob(samples) - Normal(mean, sigma).log_prob(samples)).sum(-1)
    from common.diagnostics import ratio_sensitivity

    predicted = ratio_sensitivity(300, sigma, "sum", shift)  # first order in the shift
    second_order = 300 * shift**2 / (2 * sigma**2)
    assert abs(float(logratio.mean()) - (predicted - second_order)) / predicted < 0.01
    assert abs(float(logratio.mean()) - predicted) / predicted < 0.1


def test_compiled_steps_are_refused_in_one_line_where_no_kernel_compiler_is_installed(monkeypatch) -> None:
    """actors.speed.compile_steps on a machine without the compiler torch.compile builds its kernels with: refused by the
    actor when it starts, naming the option, not at its first decision in a long trace."""
    import shutil

    policy = make_policy()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    refusal = r"^actors\.speed\.compile_steps: .* cpu kernels .*\(\$CXX or g\+\+ / clang\+\+\).*actors\.speed\.compile_steps: false$"
    with pytest.raises(ConfigError, match=refusal):
        compile_steps(policy, "actors.speed.compile_steps")
    assert policy.compiled_step is None
    monkeypatch.setenv("CXX", "/opt/toolchain/bin/g++")
    monkeypatch.setattr(shutil, "which", lambda name: name if name == "/opt/toolchain/bin/g++" else None)
    compile_steps(policy, "actors.speed.compile_steps")  # the compiler $CXX names
    assert policy.compiled_step is not None
