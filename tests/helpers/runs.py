"""Whole `learner.main` runs on the tests' local Ray, and the figures two of them must share."""

from __future__ import annotations

from pathlib import Path

from common.metrics import MetricsLog
from common.policy import WEIGHTS_FILE
from tests.conftest import tiny_run
from tests.helpers import fault_injection

# Per iteration: what a disturbed run must repeat of an undisturbed one, bit for bit.
COMPARED = ("rollout/env_steps", "rollout/total_env_steps", "rollout/episode_return", "losses/pg_loss", "losses/v_loss")


def rows_by_iteration(run_dir: Path) -> dict[int, dict]:
    return {int(row["iteration"]): row for row in MetricsLog(run_dir / "metrics.jsonl").read()}


def undisturbed_run(run_dir: Path, checkpoint: Path, fault_plan: Path, settings: dict) -> Path:
    """The small run with `settings`, no fault armed: the reference of the disturbed ones."""
    from learner.main import main

    fault_injection.arm(fault_plan)
    assert main(tiny_run(run_dir, checkpoint, **settings)) == 0
    return run_dir


def assert_same_run(run_dir: Path, reference: Path, iterations: int) -> None:
    """Every iteration's compared figures and the final weights are the reference's, bit for bit."""
    got, want = rows_by_iteration(run_dir), rows_by_iteration(reference)
    assert sorted(got) == sorted(want) == list(range(1, iterations + 1))
    for iteration, row in want.items():
        assert {k: got[iteration][k] for k in COMPARED} == {k: row[k] for k in COMPARED}, f"iteration {iteration} differs"
    final = f"checkpoints/iter_{iterations:06d}/{WEIGHTS_FILE}"
    assert (run_dir / final).read_bytes() == (reference / final).read_bytes(), "final weights differ from the undisturbed run's"
