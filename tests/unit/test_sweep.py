"""learner.sweep's report tables, from hand-made trial rows."""

from __future__ import annotations

import numpy as np


def test_a_multi_task_sweep_tables_every_task_per_seed() -> None:
    """results.md's per-task table: each task's success before and after RL for each seed that finished, and the mean
    gain; a single-task sweep has none."""
    from learner.sweep import task_table

    def evaluation(rates: dict[str, float]) -> dict[str, float]:
        row = {"eval/success_rate": float(np.mean(list(rates.values())))}
        for task, rate in rates.items():
            row |= {f"eval/task/{task}/success_rate": rate, f"eval/task/{task}/success_low": rate - 0.1,
                    f"eval/task/{task}/success_high": rate + 0.1}  # fmt: skip
        return row

    rows = [
        {"seed": 0, "status": "ok", "initial": evaluation({"reach-v3": 0.5, "push-v3": 0.2}),
         "final": evaluation({"reach-v3": 0.9, "push-v3": 0.3})},
        {"seed": 1, "status": "failed", "error": "boom"},
        {"seed": 2, "status": "ok", "initial": evaluation({"reach-v3": 0.6, "push-v3": 0.2}),
         "final": evaluation({"reach-v3": 0.8, "push-v3": 0.5})},
    ]  # fmt: skip
    lines = task_table(rows).splitlines()
    assert lines[0] == "| task | seed 0: BC -> RL | seed 2: BC -> RL | mean gain |"
    assert lines[2] == "| reach-v3 | 0.50 -> 0.90 (0.80-1.00) | 0.60 -> 0.80 (0.70-0.90) | +30.0 points |"
    assert lines[3] == "| push-v3 | 0.20 -> 0.30 (0.20-0.40) | 0.20 -> 0.50 (0.40-0.60) | +20.0 points |"
    single = [{"seed": 0, "status": "ok", "initial": {"eval/success_rate": 0.5}, "final": {"eval/success_rate": 0.7}}]
    assert task_table(single) == ""
