"""The noise-injected denoising chain: time grid, sampling, and exact chain log-probs.

The chain of one decision is a_0 -> a_1 -> ... -> a_K, shape (K+1, H, A) per sample, with
    a_0 ~ N(0, s^2 I)                      s = policy.config.init_noise_std (term omitted when s = 0)
    a_{k+1} ~ N(a_k + v(a_k, t_k) dt, sigma(t_k)^2)   k = 0 .. K-1,  t_k = k / K,  dt = 1 / K
and a_K is the executed (normalised) action chunk. Every transition is an explicit Gaussian, so the
probability of a recorded chain is exact: no likelihood estimate is needed for PPO.

`time_grid` is the ONLY place the denoising times are defined; `gaussian_step` is the only place a
transition's mean and std are computed. Sampling and scoring both go through them, which is what makes
a freshly sampled chain score with ratio exactly 1 (a public ReinFlow release sampled on
linspace(0, 1, K) and scored on linspace(0, 1 - dt, K), and its ratio check failed for K > 1).

Log-prob aggregation (policy.config.log_prob_normalization):
  "sum"  : the joint log-density of the chain, summed over every Gaussian element.
  "mean" : that sum divided by the number of Gaussian elements (K*H*A, plus H*A for a_0) -- the default,
           as in ReinFlow. The PPO ratio is then the geometric mean of per-element ratios, so the clip
           range means the same thing whatever the chunk size; with "sum" a tiny shift of the mean moves
           the log-ratio by a factor of H*A more (see common.diagnostics.ratio_sensitivity).
Either way, `log_prob_per_element` is reported. It is POSITIVE whenever sigma is small (a Gaussian
density exceeds 1 near its mean once sigma < 1/sqrt(2 pi) ~ 0.4): that is normal, not an error.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from common.config import ConfigError, PolicyConfig
from common.policy import FlowPolicy, index_features

LOG_2PI = math.log(2.0 * math.pi)


def time_grid(num_steps: int, device: torch.device | None = None) -> tuple[Tensor, float]:
    """Denoising times t_k = k / K for k = 0 .. K-1 (0 = noise, 1 = action) and the Euler step dt = 1 / K."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return torch.arange(num_steps, device=device, dtype=torch.float32) / num_steps, 1.0 / num_steps


@functools.lru_cache(maxsize=256)
def step_time(num_steps: int, k: int, batch_size: int, device: torch.device) -> tuple[Tensor, float]:
    """t_k of time_grid for a batch, (batch_size,), and dt. The same tensor object for every call with the same
    arguments (never write into it), so a backend can compute what depends on t alone once per tensor rather than at
    every step of every decision (MLPFlowPolicy.embed_time), rather than building the grid anew at each step."""
    times, dt = time_grid(num_steps, device)
    return times[k].expand(batch_size), dt


def gaussian_step(policy: FlowPolicy, features: Any, action: Tensor, t: Tensor, dt: float) -> tuple[Tensor, Tensor]:
    """Mean and std (B, H, A) of the Gaussian step from `action` at times t (B,): the one place they are computed."""
    velocity, std = policy.velocity_and_sigma(action, t, features)
    return action + velocity * dt, std


def transition(policy: FlowPolicy, features: Any, action: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Mean and std (B, H, A) of the Gaussian step from a_k to a_{k+1} (policy_step)."""
    t, dt = step_time(policy.num_steps, k, action.shape[0], action.device)
    return policy_step(policy, features, action, t, dt)


def policy_step(policy: FlowPolicy, features: Any, action: Tensor, t: Tensor, dt: float) -> tuple[Tensor, Tensor]:
    """gaussian_step by the policy's compiled step when it has one (compile_steps), else eagerly."""
    if policy.compiled_step is not None:
        return policy.compiled_step(features, action, t, dt)
    return gaussian_step(policy, features, action, t, dt)


# What torch.compile builds its kernels with, by device type: (the environment variable naming the compiler, the
# compilers looked for without it): a C++ compiler for inductor's CPU kernels, a C compiler for Triton's launchers.
KERNEL_COMPILERS = {"cpu": ("CXX", ("g++", "clang++")), "cuda": ("CC", ("gcc", "clang"))}


def require_kernel_compiler(device_type: str, field: str) -> None:
    """A one-line ConfigError naming `field` (the setting that compiles: actors.speed.compile_steps, actors.speed.compile_vision)
    unless the compiler torch.compile builds `device_type` kernels with is installed (checked by the driver on a local
    run before anything starts, and by each actor)."""
    variable, names = KERNEL_COMPILERS.get(device_type, (None, ()))
    if variable is not None and not shutil.which(os.environ.get(variable) or "") and not any(map(shutil.which, names)):
        raise ConfigError(
            f"{field}: torch.compile builds its {device_type} kernels with a compiler, and none is installed "
            f"here (${variable} or {' / '.join(names)}): install one, or set {field}: false"
        )


def compile_steps(policy: FlowPolicy, field: str) -> None:
    """Run the policy's denoising steps (policy_step) as one torch.compile graph each, as `field` asks
    (actors.speed.compile_steps: sampling; learner.speed.compile_steps: scoring and its backward pass): a VLA's step is some
    2,000 ATen ops, most of them elementwise (casts, products, sums), which the compiler fuses into far fewer kernels.
    A step compiles at its first call with a new shape (a second batch size compiles once more, for every size after
    it), and again for a new grad or autocast mode; its arithmetic differs from the eager step's in float rounding
    only (tests/helpers/vla_checks.py). Weights changed in place (RolloutActor.load_weights, an optimiser step) need no new
    compile."""
    require_kernel_compiler(policy.obs_device.type, field)
    policy.compiled_step = torch.compile(functools.partial(gaussian_step, policy))


def all_transitions(policy: FlowPolicy, features: Any, chain: Tensor) -> tuple[Tensor, Tensor]:
    """Means and stds (B, K, H, A) of every step of recorded chains (B, K+1, H, A) in one pass: row k * B + b is chain
    b's step k, at t_k of time_grid and with chain b's features, so the model runs once over K * B rows instead of K
    times over B. The same steps as transition's, up to float rounding in the larger kernels."""
    batch, steps = chain.shape[0], policy.num_steps
    times, dt = time_grid(steps, chain.device)
    actions = chain[:, :-1].transpose(0, 1).reshape(steps * batch, *chain.shape[2:])
    rows = torch.arange(batch, device=chain.device).repeat(steps)
    mean, std = policy_step(policy, index_features(features, rows), actions, times.repeat_interleave(batch), dt)
    return mean.view(steps, batch, *mean.shape[1:]).transpose(0, 1), std.view(steps, batch, *std.shape[1:]).transpose(0, 1)


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Elementwise log N(x; mean, std^2)."""
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * LOG_2PI


def gaussian_entropy(std: Tensor) -> Tensor:
    """Elementwise entropy of N(., std^2)."""
    return torch.log(std) + 0.5 * (LOG_2PI + 1.0)


@dataclass
class ChainLogProb:
    log_prob: Tensor  # (B,) aggregated as the policy's config says ("mean" or "sum")
    log_prob_per_element: Tensor  # (B,) always the per-element mean
    entropy: Tensor  # (B,) mean per-element entropy of the K transitions
    mean: Tensor  # (B, K, H, A) transition means
    std: Tensor  # (B, K, H, A) transition stds


@dataclass
class ChainSample:
    chain: Tensor  # (B, K+1, H, A); chain[:, -1] is the normalised action chunk
    scores: ChainLogProb  # the behaviour log-probs, computed while sampling


def num_log_prob_elements(config: PolicyConfig) -> int:
    """Gaussian elements in one chain's log-prob: K transitions of H*A, plus a_0 when it is random (the config alone
    gives it)."""
    return config.chunk_size * config.action_dim * (config.num_steps + (1 if config.init_noise_std > 0 else 0))


def _score(policy: FlowPolicy, chain: Tensor, means: Tensor, stds: Tensor) -> ChainLogProb:
    """Aggregate the chain's Gaussian log-densities given its transition means/stds (B, K, H, A)."""
    total = gaussian_log_prob(chain[:, 1:], means, stds).flatten(1).sum(-1)
    init_std = policy.config.init_noise_std
    if init_std > 0:
        a0 = chain[:, 0]
        total = total + gaussian_log_prob(a0, torch.zeros_like(a0), torch.full_like(a0, init_std)).flatten(1).sum(-1)
    per_element = total / num_log_prob_elements(policy.config)
    log_prob = per_element if policy.config.log_prob_normalization == "mean" else total
    entropy = gaussian_entropy(stds).flatten(1).mean(-1)
    return ChainLogProb(log_prob, per_element, entropy, means, stds)


def sample_chain(
    policy: FlowPolicy,
    features: Any,
    batch_size: int,
    *,
    deterministic: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
    noise: Tensor | None = None,
) -> ChainSample:
    """Run the K Euler steps with injected noise and record the whole chain.

    deterministic=True injects no noise and starts at a_0 = 0, or from N(0, s^2) with s = policy.config.eval_init_noise_std
    (lerobot's sampler starts from N(0, I)): the evaluation policy. The returned
    scores are still those of the stochastic policy (useful as a diagnostic, never for PPO).
    noise: the chain's standard-normal draws given up front, (K+1, B, H, A): noise[0] scales into a_0 and
    noise[k+1] into step k (a CUDA graph reads them from a fixed buffer); None draws them here, step by step.
    """
    shape = (batch_size, policy.chunk_size, policy.action_dim)

    def draw(index: int) -> Tensor:
        return noise[index] if noise is not None else torch.randn(shape, generator=generator, device=device)

    init_std = policy.config.eval_init_noise_std if deterministic else policy.config.init_noise_std
    action = draw(0) * init_std
    chain, means, stds = [action], [], []
    for k in range(policy.num_steps):
        mean, std = transition(policy, features, action, k)
        action = mean if deterministic else mean + std * draw(k + 1)
        chain.append(action)
        means.append(mean)
        stds.append(std)
    chain_t = torch.stack(chain, dim=1)
    return ChainSample(chain_t, _score(policy, chain_t, torch.stack(means, 1), torch.stack(stds, 1)))


def chain_log_prob(
    policy: FlowPolicy, features: Any, chain: Tensor, recompute_steps: bool = False, steps_in_one_pass: bool = False
) -> ChainLogProb:
    """Exact log-prob of recorded chains (B, K+1, H, A) under the policy's current weights. recompute_steps: keep no
    step's activations for a backward pass, which runs each step's forward again (learner.speed.recompute_steps).
    steps_in_one_pass: all K steps in one pass (all_transitions; learner.speed.steps_in_one_pass)."""
    expected = (policy.num_steps + 1, policy.chunk_size, policy.action_dim)
    if tuple(chain.shape[1:]) != expected:
        raise ValueError(f"chain has shape {tuple(chain.shape)}, expected (B, {expected}) for this policy (K+1, H, A)")
    if steps_in_one_pass:
        if recompute_steps:
            raise ValueError("steps_in_one_pass keeps every step's activations at once: it cannot recompute them step by step")
        return _score(policy, chain, *all_transitions(policy, features, chain))
    if recompute_steps and torch.is_grad_enabled():
        step = functools.partial(torch.utils.checkpoint.checkpoint, transition, use_reentrant=False)
    else:
        step = transition
    means, stds = zip(*(step(policy, features, chain[:, k], k) for k in range(policy.num_steps)))
    return _score(policy, chain, torch.stack(means, 1), torch.stack(stds, 1))


def transition_kl(p: ChainLogProb, q: ChainLogProb, normalization: str = "mean") -> Tensor:
    """Analytic KL(p || q) (B,) between the Gaussian transitions of two policies on the same chains.

    Summed over the K transitions and H*A elements ("sum") or averaged per element ("mean"). The a_0
    prior is shared by both policies and contributes nothing.
    """
    var_ratio = (p.std / q.std) ** 2
    kl = 0.5 * (var_ratio + ((p.mean - q.mean) / q.std) ** 2 - 1.0 - torch.log(var_ratio))
    kl = kl.flatten(1)
    return kl.mean(-1) if normalization == "mean" else kl.sum(-1)
