"""Each task's figures of an update (learner.update.task_figures) against loops over the decisions, task by task."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.group.ranks import SingleRank
from learner.update.task_figures import TaskFigures

TASKS = ["reach-v3", "push-v3", "pick-place-v3"]


def test_each_tasks_figures_are_its_own_decisions_and_a_task_without_any_is_left_out() -> None:
    generator = torch.Generator().manual_seed(0)
    decisions = 40
    tasks = torch.randint(0, 2, (decisions,), generator=generator)  # pick-place has no decision
    sigma, action_abs = torch.rand(decisions, generator=generator), torch.rand(decisions, generator=generator)
    returns, values = torch.randn(decisions, generator=generator), torch.randn(decisions, generator=generator)
    kl_ref = torch.rand(decisions, generator=generator)
    figures = TaskFigures(TASKS, tasks, clip_eps=0.05)
    for name, column in {
        "sigma": sigma,
        "action_abs": action_abs,
        "returns": returns,
        "residual": returns - values,
        "kl_ref": kl_ref,
    }.items():
        figures.add_prepared(name, column)
    logratio = 0.1 * torch.randn(decisions, generator=generator, dtype=torch.float64)
    stepped = torch.arange(decisions) % 5 != 0  # every fifth decision never drawn by a step
    earlier = stepped.nonzero().squeeze(1)
    figures.record_step(earlier, torch.full((len(earlier),), 5.0))  # replaced by the later step's
    figures.record_step(earlier, logratio[earlier])

    metrics = figures.metrics(SingleRank())

    assert not any("pick-place-v3" in key for key in metrics)
    for index, task in enumerate(TASKS[:2]):
        mine = (tasks == index).numpy()
        last = logratio.numpy()[mine & stepped.numpy()]
        clipped = np.mean([abs(math.exp(x) - 1.0) > 0.05 for x in last])
        kl = np.mean([math.expm1(x) - x for x in last])
        r, v = returns.numpy()[mine].astype(np.float64), values.numpy()[mine].astype(np.float64)
        assert metrics[f"policy/task/{task}/clip_share"] == pytest.approx(clipped, abs=1e-12)
        assert metrics[f"policy/task/{task}/approx_kl"] == pytest.approx(kl, rel=1e-9)
        assert metrics[f"policy/task/{task}/sigma_mean"] == pytest.approx(sigma.numpy()[mine].mean(), rel=1e-6)
        assert metrics[f"policy/task/{task}/action_abs_mean"] == pytest.approx(action_abs.numpy()[mine].mean(), rel=1e-6)
        assert metrics[f"values/task/{task}/explained_variance"] == pytest.approx(1 - np.var(r - v, ddof=1) / np.var(r, ddof=1), rel=1e-6)
        assert metrics[f"kl_ref/task/{task}/mean"] == pytest.approx(kl_ref.numpy()[mine].mean(), rel=1e-6)
    assert 0 < metrics["policy/task/reach-v3/clip_share"] < 1


def test_kept_decisions_carry_their_own_figures() -> None:
    tasks = torch.tensor([0, 1, 1, 2, 0])
    figures = TaskFigures(TASKS, tasks, clip_eps=0.05)
    figures.add_prepared("sigma", torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    figures.add_prepared("action_abs", torch.zeros(5))
    kept = figures.keep(torch.tensor([1, 3, 4]))
    kept.record_step(torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.float64))
    metrics = kept.metrics(SingleRank())
    assert [metrics[f"policy/task/{task}/sigma_mean"] for task in TASKS] == [5.0, 2.0, 4.0]
    assert [metrics[f"policy/task/{task}/clip_share"] for task in TASKS] == [0.0, 0.0, 0.0]
