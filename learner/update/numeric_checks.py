"""The learner's numeric checks around an update, each a named warning or error (common.diagnostics): what the
actors and the learner score differently, what bfloat16 rounding does to the log-probs, and the finite values every
micro-batch must produce before its backward pass."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from common.diagnostics import BehaviourGapWarning, PrecisionGapWarning, check_finite_tensors
from common.flow import ChainLogProb, chain_log_prob
from common.observation import Observation
from common.policy import FlowPolicy

LOSS_TERMS = ("pg_loss", "v_loss", "entropy", "kl_ref")  # checked finite before every backward pass
PRECISION_GAP_ROWS = 16  # chains a bfloat16 learner also scores in float32 each iteration (precision_gap)


def precision_gap(
    policy: FlowPolicy, obs: Observation, chains: Tensor, log_probs: Tensor, steps_in_one_pass: bool, clip_eps: float
) -> float:
    """Max |log-prob| difference between a bfloat16 learner's scores of the first PRECISION_GAP_ROWS chains and the same
    weights' float32 scores, encode included; warns when it reaches half of PPO's clip range in log space. Rounding
    changes from one optimiser step to the next, so a gap that size swings the ratio across the clip on its own. Scored
    every iteration, since the gap follows the weights."""
    rows = min(PRECISION_GAP_ROWS, len(chains))
    with torch.autocast(policy.obs_device.type, enabled=False):
        exact = chain_log_prob(policy, policy.encode(obs.index(slice(0, rows))), chains[:rows], steps_in_one_pass=steps_in_one_pass)
    gap = (log_probs[:rows].float() - exact.log_prob).abs().max().item()
    limit = 0.5 * math.log1p(clip_eps)
    if gap > limit:
        warnings.warn(
            f"bfloat16 rounding moves the learner's log-probs by up to {gap:.3g} against float32 on the same weights, "
            f"more than half of the clip range log(1 + clip_eps) = {2 * limit:.3g}: PPO clips on rounding, not on the "
            f"policy's change; set learner.speed.precision: float32",
            PrecisionGapWarning,
            stacklevel=4,
        )
    return gap


def warn_on_behaviour_gap(gap: float, threshold: float | None, actors: str, learner: str, weight_version: int) -> None:
    """Warn when actors and learner score the same weights differently (the learner scores a lagged rollout with the
    weights that sampled it, so the gap means the same at any lag). actors, learner: their precisions and devices."""
    if threshold is None or gap <= threshold:
        return
    actors = actors or "not reported"
    cause = (
        "actors and learner run different precisions/devices: the ratio starts this far from 1; run the actors in the "
        "learner's precision, or raise learner.behaviour_gap_warn if the gap is accepted"
        if actors != learner
        else "same precision on both sides: look for weights that differ, a different time grid, or non-deterministic kernels"
    )
    warnings.warn(
        f"behaviour log-probs differ from the learner's by up to {gap:.3g} > learner.behaviour_gap_warn={threshold} on "
        f"weight version {weight_version}: actors {actors}, learner {learner}; {cause}",
        BehaviourGapWarning,
        stacklevel=4,
    )


def check_micro_batch(new: ChainLogProb, logratio: Tensor, metrics: dict[str, Any], where: str) -> None:
    """A micro-batch's new log-probs, ratios and loss terms are finite (NonFiniteError naming the first that is not)."""
    finite = {"new log-prob": new.log_prob, "ratio": logratio.exp(), **{k: metrics[k] for k in LOSS_TERMS if k in metrics}}
    check_finite_tensors(finite, f"learner.update {where}")
