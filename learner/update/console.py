"""What `learner.main --single-batch` prints of one update: every per-decision quantity of the rollout (shape, moments,
first values), each minibatch's figures and each micro-batch's new log-probs and ratios."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from common.console import log
from common.flow import ChainLogProb
from common.trajectory import RolloutBatch
from learner.update.batch import PreparedBatch


def _numpy(values: Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(values.detach() if isinstance(values, Tensor) else values, dtype=np.float64)


def head(values: Tensor | np.ndarray, count: int = 6) -> str:
    flat = _numpy(values).ravel()
    return "[" + ", ".join(f"{v:+.4g}" for v in flat[:count]) + (", ...]" if len(flat) > count else "]")


def describe(batch: RolloutBatch, data: PreparedBatch) -> str:
    """Every per-decision quantity of one iteration: shape, moments, first values."""
    quantities = {
        "rewards": batch.rewards,
        "discounts": batch.discounts,
        "terminated": batch.terminated,
        "truncated": batch.truncated,
        "behaviour log-prob (actor)": batch.log_probs,
        "old log-prob (learner)": data.old_log_probs,
        "behaviour log-prob (learner)": data.behaviour_log_probs,
        "per-element log-prob (actor)": batch.log_probs_per_element,
        "values": data.old_values,
        "advantages": data.advantages,
        "returns": data.returns,
    }
    lines = [f"single batch: {batch.num_decisions} decisions x {batch.num_envs} envs, {batch.env_steps} env steps"]
    for name, values in quantities.items():
        if values is None:  # GRPO: no critic values or returns; no weight lag: behaviour = old
            continue
        array = _numpy(values)
        lines.append(
            f"  {name:<30} shape {str(array.shape):<10} mean {array.mean():+.4g} std {array.std():.4g} "
            f"min {array.min():+.4g} max {array.max():+.4g} first {head(array)}"
        )
    lines += [f"  {key:<30} {value:.6g}" for key, value in data.metrics.items()]
    return "\n".join(lines)


def micro_batch_line(new: ChainLogProb, logratio: Tensor) -> str:
    return f"  new log-prob {head(new.log_prob)}  ratio {head(logratio.exp())}"


def minibatch_line(where: str, metrics: dict[str, float]) -> str:
    return f"  {where}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class UpdateConsole:
    """What an update prints when asked (`learner.main --single-batch`): the rollout as prepared, each micro-batch's new
    log-probs and ratios, each step's figures. Silent otherwise."""

    def __init__(self, verbose: bool):
        self.verbose = verbose

    def rollout(self, batch: RolloutBatch, data: PreparedBatch) -> None:
        if self.verbose:
            log.info(describe(batch, data))

    def micro_batch(self, new: ChainLogProb, logratio: Tensor) -> None:
        if self.verbose:
            log.info(micro_batch_line(new, logratio))

    def minibatch(self, where: str, figures: dict[str, float]) -> None:
        if self.verbose:
            log.info(minibatch_line(where, figures))
