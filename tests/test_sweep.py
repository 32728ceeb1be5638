"""learner.sweep: one Tune trial per seed, a table with every seed (failed ones too), the curves, and each run's
reproducibility manifest and per-group evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray

from common.file_digests import file_sha256
from learner.sweep import run_sweep, write_report
from tests.conftest import tiny_config


@pytest.fixture()
def local_ray():
    ray.shutdown()  # the sweep sizes its trials from the Ray it starts, not from one an earlier test module left up
    yield
    ray.shutdown()


@pytest.mark.slow
def test_sweep_runs_every_seed_and_reports_the_failed_one(tmp_path, bc_checkpoint, local_ray) -> None:
    base = tiny_config(tmp_path, init_checkpoint=str(bc_checkpoint), iterations=2, eval_every=1, eval_episodes=4,
                       **{"env.eval_benchmark_seeds": "[1, 6]"})  # fmt: skip
    sweep_dir = tmp_path / "sweep"
    # Seed 1's run directory already holds a run: its trial must fail, be reported, and leave that run untouched.
    (sweep_dir / "seed_1").mkdir(parents=True)
    (sweep_dir / "seed_1" / "metrics.jsonl").write_text('{"iteration": 1}\n')

    rows = run_sweep(base, [0, 1], sweep_dir)

    assert [row["seed"] for row in rows] == [0, 1]
    ok, failed = rows
    assert ok["status"] == "ok" and failed["status"] == "failed"
    assert "already holds a run" in failed["error"]
    assert (sweep_dir / "seed_1" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    assert ok["gain"] == pytest.approx(ok["final"]["eval/success_rate"] - ok["initial"]["eval/success_rate"])
    assert 0 <= ok["final"]["eval/success_low"] <= ok["final"]["eval/success_rate"] <= ok["final"]["eval/success_high"] <= 1

    table = write_report(rows, sweep_dir, "tiny sweep")
    assert "| 0 |" in table and "failed: FileExistsError" in table and "1/2 ok" in table
    assert (sweep_dir / "seeds.png").stat().st_size > 0
    assert json.loads((sweep_dir / "results.json").read_text())[1]["status"] == "failed"

    summary = json.loads((sweep_dir / "seed_0" / "summary.json").read_text())
    manifest = summary["manifest"]
    assert manifest["config"]["seed"] == 0 and manifest["config_fingerprint"] == summary["config_fingerprint"]
    assert {"torch", "ray", "metaworld", "mujoco", "numpy"} <= set(manifest["packages"])
    assert manifest["init_checkpoint"]["weights_sha256"] == file_sha256(bc_checkpoint / "model.safetensors")
    # The held-out layouts are named, and the evaluation is also reported per layout group (benchmark seed).
    assert manifest["held_out_layouts"]["benchmark_seed_and_index"][:2] == [[1, 0], [1, 1]]
    final = summary["final_eval"]
    assert final["eval/group_seed1/episodes"] == 4 and "eval/group_seed6/success_rate" not in final  # 4 layouts, all of seed 1


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
