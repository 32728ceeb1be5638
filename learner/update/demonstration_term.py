"""A stalled task's demonstrations in the update (algorithm.stall_demos).

Once a multi-task run names a task stalled (common.metrics.stalled_tasks, every stall_window iterations), the driver
hands it to the learner with the iteration from which it counts. That task's scripted demonstrations (the first
stall_demos layouts of env.demo_benchmark_seed, with pretrain.demo_noise, or the first that succeed with
pretrain.successful_demos_only: what behaviour cloning would have trained on with that many) then join every
optimiser step that trains the actor: a batch of their chunks, the velocity field's flow-matching loss on it times
algorithm.stall_bc_coef, added to the PPO loss.

Why a term and not a new start: a stalled task's never-won training layouts stay never won under the run's clipped
steps and its sampling noise, while more demonstrations of that task move it (docs/suites.md, "A stalled task,
diagnosed"); the term brings them in where the run stands, without undoing the other tasks' progress.

Every rank of a learner group draws the same batch (the generator is seeded from the run's seed, the iteration and the
step) and backpropagates its 1/N share, so the summed gradient is the learner alone's; a restarted or resumed learner
draws the same batches for the iterations it redoes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.config import RunConfig
from common.observation import Observation
from common.policy import FlowPolicy


@dataclass
class DemonstrationDraws:
    rows: np.ndarray  # the demonstration rows an update draws its batches from
    generator: torch.Generator  # its steps' draws, one after another


class DemonstrationTerm:
    """The stalled tasks' demonstrations held by the learner, and their flow-matching loss at an optimiser step."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.from_iteration: dict[str, int] = {}  # task -> the first update (0-based) whose steps add its demonstrations
        self.obs: Observation | None = None  # every held task's steps (numpy)
        self.chunks: Tensor | None = None  # (M, H, A) in env units
        self.row_tasks = np.zeros(0, dtype=np.int64)  # (M,) the index in `from_iteration` of each row's task
        self.update_draws: DemonstrationDraws | None = None  # the draws of the update in progress (start_update)

    def add(self, tasks: dict[str, int], policy: FlowPolicy) -> list[str]:
        """Hold the demonstrations of `tasks` (task -> the update from which they count); a task already held keeps the
        iteration it was added with. Returns the tasks new here. The demonstrations of every held task are collected
        again in one pass, so their instruction tokens are padded alike (the collection is deterministic)."""
        new = [task for task in tasks if task not in self.from_iteration]
        if not new:
            return []
        from common.rollout import camera_configs  # the suite's envs: imported only by a learner that holds demonstrations
        from common.suites import make_suite
        from learner.bc.training import expert_demonstrations

        self.from_iteration.update({task: int(tasks[task]) for task in new})
        count = self.config.algorithm.stall_demos
        held = list(self.from_iteration)
        self.obs, self.chunks, episodes = expert_demonstrations(
            self.config, make_suite(self.config.env), policy, camera_configs(policy.config), dict.fromkeys(held, count), warn_failed=new
        )
        self.row_tasks = np.concatenate([np.full(len(e.actions), held.index(e.layout.task)) for e in episodes])
        return new

    def draws(self, iteration: int) -> DemonstrationDraws | None:
        """Update `iteration`'s (0-based) draws: the rows of the tasks that count at it, and the generator of its steps,
        seeded alike on every rank and on a redo; None while no task counts."""
        counting = [index for index, start in enumerate(self.from_iteration.values()) if start <= iteration]
        rows = np.flatnonzero(np.isin(self.row_tasks, counting))
        return DemonstrationDraws(rows, torch.Generator().manual_seed(self.config.seed * 1_000_003 + iteration)) if rows.size else None

    def start_update(self, iteration: int, trains_actor: bool) -> None:
        """Update `iteration`'s draws for its steps to come: none while no task counts or the update leaves the actor as it is."""
        self.update_draws = self.draws(iteration) if trains_actor else None

    def backward(self, policy: FlowPolicy, ranks: int) -> dict[str, list[tuple[float, int]]]:
        """At an optimiser step of the update: the flow-matching loss of a batch of its draws, backpropagated times
        algorithm.stall_bc_coef, each of a learner group's `ranks` its share of the same batch. Returns its figure as a
        step's terms hold them, (value, rows), the same on every rank; nothing without draws."""
        if self.update_draws is None:
            return {}
        loss = self.loss(policy, self.update_draws)
        (loss * (self.config.algorithm.stall_bc_coef / ranks)).backward()
        return {"demo_bc_loss": [(float(loss.detach()), 1)]}

    def loss(self, policy: FlowPolicy, draws: DemonstrationDraws) -> Tensor:
        """The flow-matching loss on a batch of algorithm.stall_bc_batch of the draws' rows, drawn with their generator."""
        from learner.bc.training import flow_matching_loss

        size = min(self.config.algorithm.stall_bc_batch, len(draws.rows))
        picked = draws.rows[torch.randint(len(draws.rows), (size,), generator=draws.generator).numpy()]
        obs = self.obs.index(torch.from_numpy(picked)).to_torch(policy.obs_device)
        return flow_matching_loss(policy, obs, self.chunks[picked].to(policy.obs_device), draws.generator)
