"""A two-task run end to end on the tests' local Ray: per-task evaluation, plots, videos and manifest, and the run's
diagnosis (learner.diagnose)."""

from __future__ import annotations

import json

import pytest

from learner.diagnose import main as diagnose
from learner.main import main
from tests.conftest import tiny_config, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")


def test_a_two_task_run_reports_every_task(tmp_path, capsys) -> None:
    """learner.main end to end: per-task held-out success in every evaluated row and the summary, the per-task plot,
    and the manifest's held-out tasks (from a random policy: what is checked is the reporting, not the learning); the
    tasks named stalled after two windows of one iteration get their scripted demonstrations in the third update, as
    the console and the summary say."""
    run_dir = tmp_path / "run"
    fields = {"env.task": "reach-v3,pick-place-v3", "policy.obs_dim": 41, "actors.decisions_per_rollout": 10, "env.max_episode_steps": 30,
              "algorithm.minibatch_size": 12, "algorithm.update_epochs": 1, "iterations": 3, "eval_every": 3, "eval_episodes": 3,
              "eval_videos": 1, "stall_window": 1, "algorithm.stall_demos": 1}  # fmt: skip
    assert main(tiny_run(run_dir, None, "--allow-random-init", **fields)) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1]
    for task in ("reach-v3", "pick-place-v3"):
        assert row[f"eval/task/{task}/episodes"] == 3
        assert row[f"eval/task/{task}/success_low"] <= row[f"eval/task/{task}/success_rate"] <= row[f"eval/task/{task}/success_high"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["manifest"]["held_out_layouts"]["tasks"] == ["reach-v3", "pick-place-v3"]
    placed = summary["tasks_against_initial"]  # each task once, where its final success ends against its initial interval
    assert sorted(sum(placed.values(), [])) == ["pick-place-v3", "reach-v3"] and set(placed) == {"above", "inside", "below"}
    assert list(summary.get("inside_tasks", {})) == placed["inside"]  # each with its reason
    assert (run_dir / "task_curves.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    for task, reason in summary.get("inside_tasks", {}).items():
        assert f"inside         : {task}: {reason}" in printed
    assert "reach-v3" in printed and "pick-place-v3" in printed
    assert f"{len(placed['above'])} of 2 above their initial interval, {len(placed['below'])} below" in printed
    videos = sorted(path.name for path in (run_dir / "videos" / "iter_000003").glob("*.mp4"))
    assert {name.split("_")[0] for name in videos} == {"reach-v3", "pick-place-v3"}  # eval_videos per task
    helped = summary["stall_demonstrations"]
    assert helped and set(helped) <= {"reach-v3", "pick-place-v3"} and set(helped.values()) == {3}
    for task in helped:
        assert f"[stall] {task}: 1 scripted demonstrations of it join every update from iteration 3" in printed
    assert ["losses/demo_bc_loss" in one for one in rows] == [False, False, True] and row["losses/demo_bc_loss"] > 0


def test_a_runs_diagnosis_scores_its_own_evaluations_and_is_the_same_in_each_process(tmp_path, capsys) -> None:
    """learner.diagnose on a two-task run from a BC policy (its envs weighted by task, as its start says and its
    summary records): the deterministic held-out cells of the run's start (the manifest's BC checkpoint) and end are
    the run's initial and final evaluations, task by task; diagnosing the BC policy as both start and end scores the
    same in the two processes, noisy cells included (the noise is seeded), and so do its training layouts counted by
    how often repeated noisy episodes win them; a run that names no starting checkpoint, or no repeat, is refused in one
    line, before anything is written."""
    from learner.bc.training import pretrain

    fields = {"env.task": "reach-v3,pick-place-v3", "policy.obs_dim": 41, "env.max_episode_steps": 100, "eval_episodes": 6,
              "pretrain.num_demos": 5, "pretrain.train_steps": 400}  # fmt: skip
    bc = tmp_path / "bc"
    pretrain(tiny_config(tmp_path, **fields), bc, progress=False)
    run_dir = tmp_path / "run"
    weights = {"pick-place-v3": 10.0}  # the run's 4 envs: 1 of reach, 3 of pick-place
    assert main(tiny_run(run_dir, bc, **fields, iterations=1, eval_every=1, **{"env.task_weights": weights})) == 0
    assert "rollout envs per task (env.task_weights {'pick-place-v3': 10.0}): reach-v3 1, pick-place-v3 3" in capsys.readouterr().out

    assert diagnose([str(run_dir), "--seed", "5"]) == 0
    report = json.loads((run_dir / "diagnosis.json").read_text())
    assert report["start"]["checkpoint"] == str(bc) and report["episodes_per_task"] == 6
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task_weights"] == weights
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for task in ("reach-v3", "pick-place-v3"):
        for end, evaluation in (("start", summary["initial_eval"]), ("end", row)):
            cells = report[end]["cells"][task]
            assert set(cells) == {"training/deterministic", "training/noisy", "held-out/deterministic", "held-out/noisy"}
            assert all(cell["episodes"] == 6 and cell["low"] <= cell["success"] <= cell["high"] for cell in cells.values())
            assert cells["held-out/deterministic"]["success"] == evaluation[f"eval/task/{task}/success_rate"]
    assert report["start"]["cells"]["reach-v3"]["held-out/deterministic"]["success"] > 0  # the check above is not 0 == 0
    table = capsys.readouterr().out
    assert table.count("| reach-v3 |") == 1 and "| **mean** |" in table and "held-out, noisy" in table

    assert diagnose([str(run_dir), "--checkpoint", str(bc), "--seed", "5", "--repeats", "3"]) == 0
    again = json.loads((run_dir / "diagnosis.json").read_text())
    assert again["start"]["cells"] == again["end"]["cells"] == report["start"]["cells"]  # the first repeat is the noisy cell
    assert again["start"]["layout_outcomes"] == again["end"]["layout_outcomes"]
    for task, outcome in again["end"]["layout_outcomes"].items():
        assert outcome["layouts"] == 6 and outcome["never"] + outcome["sometimes"] + outcome["always"] == pytest.approx(1.0)
        noisy = again["end"]["cells"][task]["training/noisy"]["success"]
        assert outcome["always"] <= noisy <= 1.0 - outcome["never"]
    assert "never / sometimes / always" in capsys.readouterr().out
    assert diagnose([str(run_dir), "--repeats", "0"]) == 2

    unnamed = tmp_path / "random_init_run"
    unnamed.mkdir()
    (unnamed / "run_config.json").write_text((run_dir / "run_config.json").read_text())
    (unnamed / "summary.json").write_text(json.dumps({"manifest": {"init_checkpoint": None}}))
    capsys.readouterr()
    assert diagnose([str(unnamed)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (unnamed / "diagnosis.json").exists()
