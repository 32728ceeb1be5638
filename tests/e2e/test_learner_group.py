"""`learner.main` runs with a learner group of two ranks on the tests' local Ray: a rank killed in the middle of an
update brings the group down and back from the latest checkpoint, and the run ends with an undisturbed group run's
results bit for bit; a run checkpointed by two sharded ranks goes on with one, and one checkpointed by one goes on
with two."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from learner.main import main
from tests.conftest import tiny_run
from tests.helpers import fault_injection
from tests.helpers.runs import COMPARED, assert_same_run, rows_by_iteration, undisturbed_run

pytestmark = pytest.mark.usefixtures("local_ray")

ITERATIONS = 3
# 2 minibatches x 2 epochs: 4 optimiser steps an iteration; a checkpoint every 2 iterations and at the end.
SETTINGS = {"iterations": ITERATIONS, "checkpoint_every": 2, "learner.num_learners": 2}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, bc_checkpoint, fault_plan) -> Callable[[str], Path]:
    """The undisturbed group run with `learner.sharding` = the argument, run once per module."""
    runs: dict[str, Path] = {}

    def run(sharding: str = "none") -> Path:
        if sharding not in runs:
            settings = {**SETTINGS, "learner.sharding": sharding}
            runs[sharding] = undisturbed_run(tmp_path_factory.mktemp("group") / "run", bc_checkpoint, fault_plan, settings)
        return runs[sharding]

    return run


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_rank_killed_mid_update_restarts_the_group_and_the_run_ends_as_the_undisturbed_one(
    tmp_path, bc_checkpoint, undisturbed, fault_plan, capsys, sharding
) -> None:
    """A rank SIGKILLed in iteration 3's update: the group goes down (a sharded rank left waiting in a gather with it)
    and comes back from iter_2, and the run ends as the undisturbed group run with the same sharding, bit for bit."""
    fault_injection.arm(fault_plan, kill_learner_at_optimizer_step=4 * 2 + 2)  # in iteration 3's update, past iter_2
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert main(tiny_run(run_dir, bc_checkpoint, **{**SETTINGS, "learner.sharding": sharding})) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[fault\] the learner died .*: restarting it \(1/\d\) from .*iter_000002", out), out
    assert out.count("[start] learner group: rank 0 on 127.0.0.1, rank 1 on 127.0.0.1") == 2  # started, then again
    assert_same_run(run_dir, undisturbed(sharding), ITERATIONS)
    assert rows_by_iteration(run_dir)[ITERATIONS]["faults/learner_restarts"] == 1.0


@pytest.mark.parametrize("ranks", [(1, 2, "none"), (2, 1, "fsdp")], ids=["one-then-two", "two-sharded-then-one"])
def test_a_run_goes_on_with_another_number_of_learner_ranks(tmp_path, bc_checkpoint, undisturbed, fault_plan, monkeypatch,
                                                            ranks) -> None:  # fmt: skip
    """The first launch stops after iteration 2 (a bug in the driver), its progress saved; --resume goes on with the other
    number of ranks. Iteration 3 samples with the checkpoint's weights, so its rollouts are those of the same run left
    alone, and its update is that run's up to float rounding. The two-rank launch is sharded: its run is the unsharded
    group's up to float rounding, and its checkpoint, gathered from the shards, is what a learner alone goes on from."""
    from learner.runtime import reporting

    fault_injection.arm(fault_plan)
    first, then, sharding = ranks
    run_dir = tmp_path / "run"
    argv = tiny_run(run_dir, bc_checkpoint, **{**SETTINGS, "learner.num_learners": first, "learner.sharding": sharding})
    console_line = reporting.console_line

    def buggy_console_line(metrics):
        if metrics["iteration"] == 2:
            raise RuntimeError("a bug in the driver")
        return console_line(metrics)

    monkeypatch.setattr(reporting, "console_line", buggy_console_line)
    with pytest.raises(RuntimeError, match="a bug in the driver"):
        main(argv)
    monkeypatch.undo()
    assert main([*argv, "--set", f"learner.num_learners={then}", "--set", "learner.sharding=none", "--resume"]) == 0
    got = rows_by_iteration(run_dir)
    assert sorted(got) == list(range(1, ITERATIONS + 1)) and (run_dir / f"checkpoints/iter_{ITERATIONS:06d}").is_dir()
    if first == 2:  # the undisturbed run's first two iterations, then iteration 3's rollouts and its update
        want = rows_by_iteration(undisturbed())
        for iteration in (1, 2):
            assert {k: got[iteration][k] for k in COMPARED} == pytest.approx({k: want[iteration][k] for k in COMPARED}, rel=1e-3, abs=1e-6)
        assert got[3]["rollout/env_steps"] == want[3]["rollout/env_steps"]
        assert got[3]["losses/pg_loss"] == pytest.approx(want[3]["losses/pg_loss"], rel=1e-3, abs=1e-6)
