"""A learner that stops answering mid-run (its process stopped, so the update in progress never returns) is killed
once its call's deadline passes and restarted from the run's checkpoint, as a dead one is: the run ends with exactly
the results of an undisturbed run. The run and its comparison are tests/test_faults.py's."""

from __future__ import annotations

import json
import re
import signal

import pytest

from learner.main import main
from tests.test_faults import assert_same_run, local_ray, rows, run_args, signal_when

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(local_ray.__name__)]  # this module's own local Ray


def test_a_wedged_learner_is_killed_and_restarted_with_the_undisturbed_results(tmp_path, bc_checkpoint, capsys) -> None:
    undisturbed, run_dir = tmp_path / "undisturbed", tmp_path / "run"
    assert main(run_args(undisturbed, bc_checkpoint)) == 0
    assert "[fault]" not in capsys.readouterr().out
    stopper = signal_when(run_dir, "LearnerActor", signal.SIGSTOP, after_rows=2)
    # A 20 s deadline: far above a tiny update (well under a second), so only the stopped learner misses it.
    assert main(run_args(run_dir, bc_checkpoint, "--set", "learner.call_timeout_s=20")) == 0
    stopper.join(timeout=1)
    out = capsys.readouterr().out
    wedged = r"\[fault\] the learner wedged \(no answer to \w+ within [\d.]+s \(learner\.call_timeout_s, .*\); killed\): restarting"
    assert re.search(wedged, out), out
    assert out.count("[fault]") == 1
    assert rows(run_dir)[-1]["faults/learner_restarts"] == 1.0
    assert_same_run(run_dir, undisturbed)  # the iterations since the checkpoint redone, bit for bit
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults"]["faults/learner_restarts"] == 1.0
    assert summary["env_steps"] == rows(undisturbed)[-1]["rollout/total_env_steps"]
