"""Named diagnostics for the ways flow-policy RL runs are known to explode.

Each failure mode ends in an exception or warning whose name says what went wrong and whose message
says what to change:
  NonDeterministicPolicyError  same weights, same chain, different log-prob (dropout / train mode):
                               the PPO ratio is not 1 before any update and the KL reads ~1e8.
  RatioSensitivityWarning      log-probs aggregated so that a tiny change of the policy swings the ratio
                               past any clip range (summed over hundreds of elements with small sigma).
  NonFiniteError               NaN/Inf in a loss, gradient, rollout or environment output; raised
                               BEFORE the optimiser step, so the weights are never corrupted.
  RandomInitError              fine-tuning a policy that was never loaded from a checkpoint.
  BehaviourGapWarning          the actors' behaviour log-probs and the learner's recomputation of them on
                               the same weights disagree (different precisions or devices, or a bug).
  PrecisionGapWarning          a bfloat16 learner's rounding moves its own log-probs by a sizeable part of
                               the clip range: PPO would clip on rounding, not on the policy's change.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn


class NonDeterministicPolicyError(RuntimeError):
    """Two evaluations of the same chains under the same weights disagree."""


class RatioSensitivityWarning(UserWarning):
    """The configuration makes the PPO ratio hypersensitive to small policy changes."""


class BehaviourGapWarning(UserWarning):
    """Behaviour log-probs from the actors differ from the learner's on the same weight version."""


class PrecisionGapWarning(UserWarning):
    """A bfloat16 learner's log-probs differ from its float32 ones by a sizeable part of PPO's clip range."""


class ShortRolloutWarning(UserWarning):
    """Every rollout ends before an episode can: the steps past it are never sampled, and success counts only the quick."""


class NonFiniteError(FloatingPointError):
    """A loss, gradient or input holds NaN or Inf."""


class NonFiniteUpdateWarning(RuntimeWarning):
    """An iteration's update met a NaN/Inf and was rolled back and skipped."""


class MicroBatchSplitWarning(RuntimeWarning):
    """An update ran out of GPU memory and runs again with its minibatches split into smaller micro-batches."""


class RandomInitError(RuntimeError):
    """The policy to fine-tune was not loaded from a checkpoint."""


def stochastic_modules(module: nn.Module) -> list[str]:
    """Names of submodules whose forward pass is random or batch-dependent in their current mode."""
    found = []
    for name, sub in module.named_modules():
        if not sub.training:
            continue
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            found.append(f"{name or type(module).__name__} ({type(sub).__name__}, p={sub.p}, train mode)")
        elif isinstance(sub, nn.modules.batchnorm._BatchNorm):
            found.append(f"{name} ({type(sub).__name__}, train mode)")
    return found


def nondeterminism_report(module: nn.Module, max_abs_logratio: float) -> str:
    culprits = stochastic_modules(module)
    where = (
        "modules in train mode with randomness: " + ", ".join(culprits[:10])
        if culprits
        else "no dropout/batch-norm in train mode was found: look for random ops, non-deterministic kernels, "
        "or a time grid that differs between sampling and scoring"
    )
    return (
        f"same weights and chains gave log-probs differing by up to {max_abs_logratio:.3g} "
        f"(ratio up to exp({max_abs_logratio:.3g})) before any update; {where}. "
        "Recompute log-probs in eval mode (policy.eval()): dropout must be off for both old and new log-probs."
    )


def check_ratio_is_one(logratio: Tensor, module: nn.Module, tolerance: float) -> float:
    """Raise NonDeterministicPolicyError if any |ratio - 1| > tolerance; return the max |ratio - 1|.

    Call this on the first minibatch of an iteration, before any optimiser step: the new and old
    log-probs were computed with identical weights, so anything but ratio == 1 is a bug.
    """
    deviation = float((logratio.detach().exp() - 1.0).abs().max())
    if not math.isfinite(deviation) or deviation > tolerance:
        raise NonDeterministicPolicyError(nondeterminism_report(module, float(logratio.detach().abs().max())))
    return deviation


# -- ratio sensitivity ------------------------------------------------------------------------------

SENSITIVITY_SHIFT = 0.01  # per-element shift of the transition means, in normalised action units
SENSITIVITY_LIMIT = 1.0  # |change of log-ratio| beyond every clip range PPO uses (ratio x e)


def ratio_sensitivity(num_elements: int, sigma: float, normalization: str, shift: float = SENSITIVITY_SHIFT) -> float:
    """Expected |change of one sample's log-ratio| when every transition mean moves by `shift`
    towards the sample (the move a PPO step makes for a positive advantage).

    d log N(a; mu, sigma^2) / d mu = (a - mu) / sigma^2 and E|a - mu| = sigma sqrt(2 / pi), so over n
    aggregated elements the log-ratio moves by n * shift * sqrt(2/pi) / sigma, with n = num_elements for
    "sum" and n = 1 for "mean" (the per-element mean divides the sum by num_elements).
    """
    n = num_elements if normalization == "sum" else 1
    return n * shift * math.sqrt(2.0 / math.pi) / sigma


def check_ratio_sensitivity(num_elements: int, sigma_min: float, normalization: str, clip_eps: float) -> float:
    """Warn (RatioSensitivityWarning) when a 0.01 per-element shift moves the log-ratio by more than 1.

    The limit is absolute, not the configured clip range: ReinFlow's own recipe (per-element mean,
    sigma >= 0.08, clip 0.01) moves the log-ratio by ~0.1 for this shift and trains well with a small
    learning rate, whereas summing over H*A = 300 elements with sigma = 0.1 moves it by ~24: every
    sample is clipped after the first step, whatever the learning rate.
    Returns the predicted move (also printed in the run banner).
    """
    move = ratio_sensitivity(num_elements, sigma_min, normalization)
    if move > SENSITIVITY_LIMIT:
        needed_sigma = ratio_sensitivity(num_elements, 1.0, normalization) / SENSITIVITY_LIMIT
        warnings.warn(
            f"PPO ratio is hypersensitive: a {SENSITIVITY_SHIFT} shift of each action element's mean moves the "
            f"log-ratio by ~{move:.3g} (clip range is +-{clip_eps}), with log-probs aggregated by {normalization!r} over "
            f"{num_elements} elements and sigma_min={sigma_min}. Every update will be clipped. Fix: set "
            f"policy.log_prob_normalization='mean' (per element, as ReinFlow), or raise sigma_min to >= {needed_sigma:.3g}. "
            f"Scaling sigma by sqrt(D / D_ref) (ReinFlow's D_ref = 28 -> {sigma_min * math.sqrt(num_elements / 28):.3g}) keeps "
            "the ratio's variance at the reference level, but this shift still moves it by D * shift / sigma.",
            RatioSensitivityWarning,
            stacklevel=2,
        )
    return move


def check_rollout_length(decisions: int, chunk_size: int, max_episode_steps: int) -> None:
    """Warn (ShortRolloutWarning) when a rollout's env steps cannot hold a whole episode. Every rollout starts its envs
    afresh, so an episode that has not ended by then is cut: the policy never acts past that step, and the training
    success rates count the episodes that ended, the quick successes, never the failures that run to the limit."""
    steps = decisions * chunk_size
    if steps < max_episode_steps:
        warnings.warn(
            f"a rollout of actors.decisions_per_rollout={decisions} chunks of policy.chunk_size={chunk_size} is {steps} env steps, "
            f"fewer than env.max_episode_steps={max_episode_steps}: no episode runs past step {steps}, and the training success "
            f"rates count only episodes that ended sooner. Set actors.decisions_per_rollout: {-(-max_episode_steps // chunk_size)}",
            ShortRolloutWarning,
            stacklevel=2,
        )


# -- finiteness -------------------------------------------------------------------------------------


def check_finite_tensors(tensors: Mapping[str, Tensor], where: str) -> None:
    bad = [name for name, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise NonFiniteError(f"{where}: non-finite values (NaN/Inf) in {bad}")


def check_finite_gradients(module: nn.Module, where: str) -> None:
    bad = [name for name, p in module.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        raise NonFiniteError(f"{where}: non-finite gradients in {bad[:5]}")


def check_finite_arrays(arrays: Mapping[str, np.ndarray], where: str) -> None:
    bad = [name for name, a in arrays.items() if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()]
    if bad:
        raise NonFiniteError(f"{where}: non-finite values (NaN/Inf) in {bad}")
