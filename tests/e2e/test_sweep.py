"""learner.sweep: one Tune trial per seed, a table with every seed (failed ones too), the curves, and each run's
reproducibility manifest and per-group evaluation."""

from __future__ import annotations

import json

import pytest

from common.file_digests import file_sha256
from learner.sweep import run_sweep, write_report
from tests.conftest import tiny_config


def test_sweep_runs_every_seed_and_reports_the_failed_one(tmp_path, bc_checkpoint, no_ray) -> None:
    """The sweep starts its own Ray and sizes its trials from it."""
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
