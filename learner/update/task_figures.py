"""Each task's own figures in a multi-task update: whether its policy moves, and what may hold it where it is.

A task that stalls (common.metrics.stalled_tasks) is told apart from one that moves by these, logged every iteration:

  policy/task/<task>/clip_share        the share of its decisions whose ratio lay outside [1 - clip_eps, 1 + clip_eps]
                                       at the last optimiser step that drew them (the update's last epoch)
  policy/task/<task>/approx_kl         the k3 estimate of KL(old || new) at those same steps (as losses/approx_kl)
  policy/task/<task>/sigma_mean        the sampling noise's std at its decisions, over the chain's elements
  policy/task/<task>/action_abs_mean   the mean |action| of its chunks (normalised): the scale the noise acts on
  values/task/<task>/explained_variance  the critic's explained variance of its returns (PPO)
  kl_ref/task/<task>/mean              its per-element KL to the reference policy (algorithm.kl_beta > 0)

Every figure is pooled from sums over the learner's ranks, so a learner group reports what the learner alone would.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from common.rl import explained_variance_of_moments, k3
from learner.group.ranks import SingleRank


class TaskFigures:
    """Per-decision quantities of one update, kept by the task each decision was sampled in."""

    def __init__(self, tasks: list[str], decision_tasks: Tensor, clip_eps: float):
        """decision_tasks (B,): the index in `tasks` of each decision this rank holds, in the prepared batch's order."""
        self.tasks, self.clip_eps = tasks, clip_eps
        self.decision_tasks = decision_tasks.cpu()
        self.last_logratio = torch.full((len(decision_tasks),), math.nan, dtype=torch.float64)
        # name -> (B,) float64, from the update's preparation: sigma, action_abs, returns and residual (returns - values), kl_ref
        self.prepared: dict[str, Tensor] = {}

    def keep(self, rows: Tensor) -> TaskFigures:
        """The figures of the decisions `rows` (the ones that enter the loss), in that order."""
        kept = TaskFigures(self.tasks, self.decision_tasks[rows.cpu()], self.clip_eps)
        kept.prepared = {name: values[rows.cpu()] for name, values in self.prepared.items()}
        return kept

    def add_prepared(self, name: str, values: Tensor) -> None:
        self.prepared[name] = values.detach().to("cpu", torch.float64)

    def record_step(self, rows: Tensor, logratio: Tensor) -> None:
        """The log-ratios of decisions `rows` at the optimiser step that drew them (a later step's replace an earlier's)."""
        self.last_logratio[rows.cpu()] = logratio.detach().to("cpu", torch.float64)

    def metrics(self, ranks: SingleRank) -> dict[str, float]:
        """Each task's figures over every rank's decisions of it; a task no rank holds a decision of is left out."""
        stepped = ~self.last_logratio.isnan()
        logratio = torch.where(stepped, self.last_logratio, 0.0)
        clipped = stepped & ((logratio.exp() - 1.0).abs() > self.clip_eps)
        kl = torch.where(stepped, k3(torch.zeros_like(logratio), logratio), 0.0)
        columns = {
            "decisions": torch.ones_like(logratio),
            "stepped": stepped.double(),
            "clipped": clipped.double(),
            "kl": kl,
            **self.prepared,
        }
        if "returns" in self.prepared:  # the moments explained_variance_of_moments reads
            columns |= {"returns_sq": self.prepared["returns"] ** 2, "residual_sq": self.prepared["residual"] ** 2}
        names = list(columns)
        table = torch.stack([columns[name] for name in names], dim=1)  # (B, columns)
        sums = torch.zeros(len(self.tasks), len(names), dtype=torch.float64).index_add_(0, self.decision_tasks, table)
        pooled = torch.tensor(ranks.sums(sums.flatten().tolist()), dtype=torch.float64).view_as(sums)
        metrics = {}
        for task, row in zip(self.tasks, pooled.tolist()):
            total = dict(zip(names, row))
            count, steps = total["decisions"], total["stepped"]
            if not count:
                continue
            if steps:
                metrics[f"policy/task/{task}/clip_share"] = total["clipped"] / steps
                metrics[f"policy/task/{task}/approx_kl"] = total["kl"] / steps
            if "sigma" in total:
                metrics[f"policy/task/{task}/sigma_mean"] = total["sigma"] / count
                metrics[f"policy/task/{task}/action_abs_mean"] = total["action_abs"] / count
            if "returns" in total:
                moments = {
                    "returns_mean": total["returns"] / count,
                    "returns_sq_mean": total["returns_sq"] / count,
                    "residual_mean": total["residual"] / count,
                    "residual_sq_mean": total["residual_sq"] / count,
                }
                metrics[f"values/task/{task}/explained_variance"] = explained_variance_of_moments(moments, int(count))
            if "kl_ref" in total:
                metrics[f"kl_ref/task/{task}/mean"] = total["kl_ref"] / count
        return metrics
