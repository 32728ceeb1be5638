"""A rollout as the update reads it: flattened to B = T * N decisions, with the learner's own old log-probs, values and
advantages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from common.flow import ChainLogProb
from common.observation import Observation
from learner.update.task_figures import TaskFigures


@dataclass
class PreparedBatch:
    """A rollout flattened to B = T * N decisions, with the learner's own old log-probs and values."""

    obs: Observation  # (B, ...) torch, on the policy's device: state, and frames (or their vision tokens)/tokens when the policy reads them
    chains: Tensor  # (B, K+1, H, A)
    old_log_probs: Tensor  # (B,)  recomputed by the learner with the current weights, eval mode
    old_values: Tensor | None  # (B,)  None with GRPO (no critic)
    advantages: Tensor  # (B,)  normalised if configured; GRPO: the episode's group-relative advantage
    returns: Tensor | None  # (B,)  the critic's targets; None with GRPO
    metrics: dict[str, float]
    # encode(obs), computed once per iteration and reused in every epoch and minibatch when no trainable
    # parameter feeds encode() (the MLP; SmolVLA with a frozen VLM). None: re-encode every micro-batch.
    features: Any = None
    reference: ChainLogProb | None = None  # (B, ...) the reference policy's scores of the chains, when kl_beta > 0
    # (B,) the learner's scores of the chains under the weights that sampled them, when those are older than the
    # current ones (actors.policy_lag > 0); None: the chains came from the current weights (behaviour = old).
    behaviour_log_probs: Tensor | None = None
    # (B_all,) for each decision of the whole update (every rank's, in the order one learner would hold them), its row
    # in this batch, or -1 where another rank holds it; one learner alone holds every row, in order.
    rows_here: Tensor | None = None
    # Each task's figures of a multi-task update (the decisions that enter the loss); None in a one-task run.
    task_figures: TaskFigures | None = None

    def rows_held(self, minibatch: Tensor) -> Tensor:
        """This rank's rows of `minibatch` (positions among the whole update's decisions), in the minibatch's order."""
        here = self.rows_here[minibatch]
        return here[here >= 0]
