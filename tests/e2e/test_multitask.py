"""A two-task run end to end on the tests' local Ray: per-task evaluation, plots, videos and manifest."""

from __future__ import annotations

import json

import pytest

from learner.main import main
from tests.conftest import tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")


def test_a_two_task_run_reports_every_task(tmp_path, capsys) -> None:
    """learner.main end to end: per-task held-out success in every evaluated row and the summary, the per-task plot,
    and the manifest's held-out tasks (from a random policy: what is checked is the reporting, not the learning)."""
    run_dir = tmp_path / "run"
    fields = {"env.task": "reach-v3,pick-place-v3", "policy.obs_dim": 41, "actors.decisions_per_rollout": 6, "env.max_episode_steps": 30,
              "algorithm.minibatch_size": 12, "algorithm.update_epochs": 1, "iterations": 1, "eval_every": 1, "eval_episodes": 3,
              "eval_videos": 1}  # fmt: skip
    assert main(tiny_run(run_dir, None, "--allow-random-init", **fields)) == 0
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for task in ("reach-v3", "pick-place-v3"):
        assert row[f"eval/task/{task}/episodes"] == 3
        assert row[f"eval/task/{task}/success_low"] <= row[f"eval/task/{task}/success_rate"] <= row[f"eval/task/{task}/success_high"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["manifest"]["held_out_layouts"]["tasks"] == ["reach-v3", "pick-place-v3"]
    assert (run_dir / "task_curves.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "reach-v3" in printed and "pick-place-v3" in printed
    videos = sorted(path.name for path in (run_dir / "videos" / "iter_000001").glob("*.mp4"))
    assert {name.split("_")[0] for name in videos} == {"reach-v3", "pick-place-v3"}  # eval_videos per task
