"""learner.sweep's report tables, from hand-made trial rows."""

from __future__ import annotations

import numpy as np


def test_a_multi_task_sweep_tables_every_task_per_seed() -> None:
    """results.md's per-task table: each task's success before and after RL, with both intervals, for each seed that
    finished, the mean gain, and per seed the tasks that ended above and below their BC interval (a task inside it
    counts as neither); a single-task sweep has none."""
    from learner.sweep import task_table

    def evaluation(rates: dict[str, float]) -> dict[str, float]:
        row = {"eval/success_rate": float(np.mean(list(rates.values())))}
        for task, rate in rates.items():
            row |= {f"eval/task/{task}/success_rate": rate, f"eval/task/{task}/success_low": rate - 0.1,
                    f"eval/task/{task}/success_high": rate + 0.1}  # fmt: skip
        return row

    rows = [
        {"seed": 0, "status": "ok", "initial": evaluation({"reach-v3": 0.5, "push-v3": 0.2, "door-open-v3": 0.4}),
         "final": evaluation({"reach-v3": 0.9, "push-v3": 0.05, "door-open-v3": 0.45})},
        {"seed": 1, "status": "failed", "error": "boom"},
        {"seed": 2, "status": "ok", "initial": evaluation({"reach-v3": 0.6, "push-v3": 0.2, "door-open-v3": 0.4}),
         "final": evaluation({"reach-v3": 0.8, "push-v3": 0.5, "door-open-v3": 0.25})},
    ]  # fmt: skip
    lines = task_table(rows).splitlines()
    assert lines[0] == "| task | seed 0: BC -> RL | seed 2: BC -> RL | mean gain |"
    assert lines[2] == "| reach-v3 | 0.50 (0.40-0.60) -> 0.90 (0.80-1.00) | 0.60 (0.50-0.70) -> 0.80 (0.70-0.90) | +30.0 points |"
    assert lines[3] == "| push-v3 | 0.20 (0.10-0.30) -> 0.05 (-0.05-0.15) | 0.20 (0.10-0.30) -> 0.50 (0.40-0.60) | +7.5 points |"
    assert lines[5:] == ["| tasks above their BC interval | 1 of 3 | 2 of 3 | |", "| tasks below their BC interval | 1 of 3 | 1 of 3 | |"]
    single = [{"seed": 0, "status": "ok", "initial": {"eval/success_rate": 0.5}, "final": {"eval/success_rate": 0.7}}]
    assert task_table(single) == ""
