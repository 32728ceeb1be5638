"""What looks at an update without changing it, called by the update at a few fixed points: the console (learner.main
--single-batch), each micro-batch's numeric checks and, on the update's first step, its ratio == 1 check, each task's
figures (TaskFigures), and each optimiser step's figures, kept for the update's metrics."""

from __future__ import annotations

from torch import Tensor

from common.diagnostics import check_ratio_is_one
from common.flow import ChainLogProb
from common.policy import FlowPolicy
from common.trajectory import RolloutBatch
from learner.group.sharding import Deferred
from learner.update.batch import PreparedBatch
from learner.update.console import UpdateConsole
from learner.update.numeric_checks import check_micro_batch


class UpdateWatch:
    """One update's watch, from its prepared rollout to its last optimiser step."""

    def __init__(self, data: PreparedBatch, policy: FlowPolicy, ratio_tolerance: float, verbose: bool):
        self.data, self.policy, self.ratio_tolerance = data, policy, ratio_tolerance
        self.console = UpdateConsole(verbose)
        self.history: dict[str, list[float]] = {}  # each step's figures, in order
        self.steps = 0
        self.first_ratio_deviation = 0.0  # max |ratio - 1| over the first step's chains

    def rollout(self, batch: RolloutBatch) -> None:
        self.console.rollout(batch, self.data)

    def micro_batch(self, where: str, rows: Tensor, new: ChainLogProb, metrics: dict[str, Tensor], checks: Deferred) -> None:
        """Decisions `rows`' new scores and loss terms, before their backward pass; `checks` holds a failure back where the
        ranks must end the minibatch together."""
        logratio = new.log_prob - self.data.old_log_probs[rows]
        with checks:
            check_micro_batch(new, logratio, metrics, where)
            if self.steps == 0:  # the old log-probs' weights are the current ones
                deviation = check_ratio_is_one(logratio, self.policy, self.ratio_tolerance)
                self.first_ratio_deviation = max(self.first_ratio_deviation, deviation)
        self.console.micro_batch(new, logratio)
        if self.data.task_figures is not None:
            self.data.task_figures.record_step(rows, logratio)

    def step(self, where: str, figures: dict[str, float]) -> None:
        """An optimiser step's figures, over every rank's decisions."""
        self.steps += 1
        for key, value in figures.items():
            self.history.setdefault(key, []).append(value)
        self.console.minibatch(where, figures)
